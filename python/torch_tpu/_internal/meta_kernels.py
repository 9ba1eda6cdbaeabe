"""Meta (shape) functions PyTorch lacks for ops torch_tpu lowers: the dispatch path takes output
shapes from them. The fused RNN cell ops have CUDA kernels only upstream (csrc/lowering/rnn.cc):
PyTorch has no meta for the GRU ones, and its LSTM one fails without biases (nn.LSTM(bias=False)).
_logcumsumexp and multi_margin_loss_backward have CPU/CUDA kernels only (csrc/lowering lowers them)."""

from __future__ import annotations

import torch

_lib: torch.library.Library | None = None


def _gru_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, hx: torch.Tensor,
              input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
              ) -> tuple[torch.Tensor, torch.Tensor]:
    torch._check(input_gates.shape == hidden_gates.shape and input_gates.dim() == 2
                 and input_gates.shape[1] == 3 * hx.shape[-1],
                 lambda: f"_thnn_fused_gru_cell: gates {list(input_gates.shape)} / {list(hidden_gates.shape)} "
                         f"do not match hx {list(hx.shape)}")
    return torch.empty_like(hx), hx.new_empty(hx.shape[0], 5 * hx.shape[1])


def _lstm_cell(input_gates: torch.Tensor, hidden_gates: torch.Tensor, cx: torch.Tensor,
               input_bias: torch.Tensor | None = None, hidden_bias: torch.Tensor | None = None
               ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    torch._check(input_gates.shape == hidden_gates.shape and input_gates.dim() == 2
                 and input_gates.shape[1] == 4 * cx.shape[-1],
                 lambda: f"_thnn_fused_lstm_cell: gates {list(input_gates.shape)} / {list(hidden_gates.shape)} "
                         f"do not match cx {list(cx.shape)}")
    return torch.empty_like(cx), torch.empty_like(cx), input_gates.new_empty(input_gates.shape)


def _gru_cell_backward(grad_hy: torch.Tensor, workspace: torch.Tensor, has_bias: bool) -> tuple[torch.Tensor | None, ...]:
    b, h = grad_hy.shape
    gates = grad_hy.new_empty(b, 3 * h)
    bias = grad_hy.new_empty(3 * h) if has_bias else None
    return gates, torch.empty_like(gates), torch.empty_like(grad_hy), bias, None if bias is None else torch.empty_like(bias)


def _logcumsumexp(self: torch.Tensor, dim: int) -> torch.Tensor:
    torch._prims_common.canonicalize_dim(self.dim(), dim)  # IndexError like the CPU kernel
    return torch.empty_like(self, memory_format=torch.contiguous_format)


def _multi_margin_loss_backward(grad_output: torch.Tensor, self: torch.Tensor, target: torch.Tensor,
                                p: float, margin: float, weight: torch.Tensor | None = None,
                                reduction: int = 1) -> torch.Tensor:
    return torch.empty_like(self, memory_format=torch.contiguous_format)


def install() -> None:
    global _lib
    if _lib is not None:
        return
    _lib = torch.library.Library("aten", "IMPL")
    _lib.impl("_thnn_fused_lstm_cell", _lstm_cell, "Meta")
    _lib.impl("_thnn_fused_gru_cell", _gru_cell, "Meta")
    _lib.impl("_thnn_fused_gru_cell_backward", _gru_cell_backward, "Meta")
    _lib.impl("_logcumsumexp", _logcumsumexp, "Meta")
    _lib.impl("multi_margin_loss_backward", _multi_margin_loss_backward, "Meta")
