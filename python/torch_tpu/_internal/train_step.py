"""One program per training step: forward, backward and the optimizer update traced together.

    trainer = torch_tpu.optimizers.SingleTraceTrainer(model, optimizer, loss_fn)
    for batch in data:
        loss = trainer(*batch)          # loss_fn(model, *batch) -> scalar loss

The step is traced once by AOTAutograd (inference mode: parameters and optimizer state are plain
inputs) as `torch.func.grad_and_value` of the loss through the model with its parameters swapped
for the traced inputs, then the optimizer's fused update (`_fused_sgd_` / `_fused_adam(w)_`,
learning rate as a tensor so schedulers do not retrace) writes parameters and state in place.
The backend turns that one graph into one program; parameters and state are donated, so the
update happens in place. Optimizer state lives in `optimizer.state` under PyTorch's own keys
(`step`, `exp_avg`, `exp_avg_sq`, `max_exp_avg_sq`, `momentum_buffer`), so `state_dict()` and
checkpoints keep working. Gradients are internal to the program: `p.grad` is not populated.

A new program is traced when a batch shape/dtype, the set of parameters, or a non-tensor
hyperparameter (betas, weight decay, momentum, ...) changes; SGD with momentum traces its first
step separately (PyTorch's first step copies the gradient into the buffer).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch

from torch_tpu._internal import compile as tpu_compile
from torch_tpu._internal import compile_meta

_SUPPORTED = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW)


class SingleTraceTrainer:
    """Runs `loss_fn(model, *batch)`, its backward and `optimizer`'s update as one program."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer,
                 loss_fn: Callable[..., torch.Tensor]) -> None:
        if not isinstance(optimizer, _SUPPORTED):
            raise TypeError(f"SingleTraceTrainer supports torch.optim.SGD, Adam and AdamW; got {type(optimizer).__name__}")
        if any(group.get("differentiable") for group in optimizer.param_groups):
            raise ValueError("SingleTraceTrainer: differentiable optimizers are not supported")
        compile_meta.install()  # fused-optimizer metas and their functionalization rule
        self.model, self.optimizer, self.loss_fn = model, optimizer, loss_fn
        self._steps: dict[tuple, Callable] = {}
        self.programs_built = 0

    # ---- optimizer state, created as torch.optim creates it
    def _state(self, p: torch.Tensor) -> dict[str, Any]:
        st = self.optimizer.state[p]
        opt = self.optimizer
        group = next(g for g in opt.param_groups if any(q is p for q in g["params"]))
        if isinstance(opt, torch.optim.SGD):
            return st
        if not st:
            st["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
            st["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            st["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            if group["amsgrad"]:
                st["max_exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        elif st["step"].device != p.device:  # a foreach/CPU-step state: the fused op wants it on device
            st["step"] = st["step"].to(p.device, torch.float32)
        return st

    def _group_key(self, group: dict[str, Any]) -> tuple:
        return tuple((k, v) for k, v in sorted(group.items()) if k not in ("params", "lr") and
                     isinstance(v, (int, float, bool, tuple, str, type(None))))

    def __call__(self, *batch: Any) -> torch.Tensor:
        opt = self.optimizer
        params = [p for g in opt.param_groups for p in g["params"] if p.requires_grad]
        names = {id(p): n for n, p in self.model.named_parameters()}
        if any(id(p) not in names for p in params):
            raise ValueError("SingleTraceTrainer: the optimizer holds tensors that are not parameters of the model")
        states = [self._state(p) for p in params]
        first_sgd = isinstance(opt, torch.optim.SGD) and any(
            g["momentum"] != 0 for g in opt.param_groups) and any("momentum_buffer" not in s for s in states)
        if first_sgd:
            for p, s in zip(params, states, strict=True):
                s["momentum_buffer"] = torch.zeros_like(p)
        lrs = [torch.as_tensor(g["lr"], dtype=torch.float64) for g in opt.param_groups]
        state_keys = sorted({k for s in states for k in s})
        flat_state = [s[k] for k in state_keys for s in states]
        key = (tuple(self._group_key(g) for g in opt.param_groups), first_sgd, tuple(state_keys),
               tuple((tuple(t.shape), t.dtype) if isinstance(t, torch.Tensor) else repr(t) for t in batch))
        step = self._steps.get(key)
        if step is None:
            step = self._trace(params, names, state_keys, first_sgd, batch)
            self._steps[key] = step
            self.programs_built += 1
        return step(params, flat_state, lrs, batch)

    def _trace(self, params: list[torch.Tensor], names: dict[int, str], state_keys: list[str], first_sgd: bool,
               batch: tuple) -> Callable:
        from torch._functorch.aot_autograd import aot_function
        from torch.nn.utils.stateless import _reparametrize_module

        model, opt, loss_fn = self.model, self.optimizer, self.loss_fn
        n = len(params)
        param_names = [names[id(p)] for p in params]
        group_of = [next(i for i, g in enumerate(opt.param_groups) if any(q is p for q in g["params"])) for p in params]
        tensor_idx = [i for i, b in enumerate(batch) if isinstance(b, torch.Tensor)]

        buffer_names = [name for name, _ in model.named_buffers()]

        def whole(ps: list[torch.Tensor], flat_state: list[torch.Tensor], lrs: list[torch.Tensor],
                  tensors: list[torch.Tensor], buffers: list[torch.Tensor]) -> torch.Tensor:
            full = list(batch)
            for i, t in zip(tensor_idx, tensors, strict=True):
                full[i] = t
            traced_buffers = dict(zip(buffer_names, buffers, strict=True))

            def loss_of(p: dict[str, torch.Tensor]) -> torch.Tensor:
                with _reparametrize_module(model, {**p, **traced_buffers}):
                    return loss_fn(model, *full)

            grads, loss = torch.func.grad_and_value(loss_of)(dict(zip(param_names, ps, strict=True)))
            state = {k: flat_state[j * n:(j + 1) * n] for j, k in enumerate(state_keys)}
            with torch.no_grad():
                for gi, group in enumerate(opt.param_groups):
                    idx = [i for i in range(n) if group_of[i] == gi]
                    if idx:
                        _update(opt, group, [ps[i] for i in idx], [grads[param_names[i]] for i in idx],
                                {k: [v[i] for i in idx] for k, v in state.items()}, lrs[gi], first_sgd)
            return loss.detach()

        traced = aot_function(whole, fw_compiler=tpu_compile.compile_graph, bw_compiler=tpu_compile.compile_graph,
                              decompositions=tpu_compile.decompositions(), keep_inference_input_mutations=True)

        def run(ps: list[torch.Tensor], flat_state: list[torch.Tensor], lrs: list[torch.Tensor],
                batch_now: tuple) -> torch.Tensor:
            device = ps[0].device
            tensors = [batch_now[i] for i in tensor_idx]
            buffers = [b for _, b in model.named_buffers()]
            with torch.no_grad(), tpu_compile.lowered_ops_stay_whole():
                return traced([p.detach() for p in ps], flat_state, [lr.to(device) for lr in lrs], tensors, buffers)
        return run


def _update(opt: torch.optim.Optimizer, group: dict[str, Any], ps: list[torch.Tensor], grads: list[torch.Tensor],
            state: dict[str, list[torch.Tensor]], lr: torch.Tensor, first_sgd: bool) -> None:
    """The optimizer's fused update on the traced tensors (in place: the program donates them)."""
    if isinstance(opt, torch.optim.SGD):
        momentum = group["momentum"]
        torch._fused_sgd_(ps, grads, state.get("momentum_buffer", []) if momentum != 0 else [],
                          weight_decay=group["weight_decay"], momentum=momentum, lr=lr,
                          dampening=group["dampening"], nesterov=group["nesterov"], maximize=group["maximize"],
                          is_first_step=first_sgd)
        return
    steps = state["step"]
    for s in steps:
        s.add_(1)
    fn = torch._fused_adamw_ if isinstance(opt, torch.optim.AdamW) else torch._fused_adam_
    beta1, beta2 = group["betas"]
    fn(ps, grads, state["exp_avg"], state["exp_avg_sq"], state.get("max_exp_avg_sq", []), steps,
       amsgrad=group["amsgrad"], lr=lr, beta1=beta1, beta2=beta2, weight_decay=group["weight_decay"],
       eps=group["eps"], maximize=group["maximize"])
