"""The reference for bench_compile's prefill and decode: the same tiny Llama written with plain
`jax.numpy` and `jax.jit` (JAX is a benchmark-only dependency), on the same weights and shapes, on
JAX's own XLA:CPU client. What XLA can do with this model when the program comes from JAX.

JaxPrefill: one prefill step, as the torch step does it: embeddings, per layer RMSNorm -> GQA
attention with RoPE (causal) writing K/V into a static cache of `cache_len` -> RMSNorm -> SwiGLU
MLP, final norm, lm_head on the last position, argmax. Its attention reads the whole updated cache
(`cache_len` keys, those past each query's position masked), as HF's StaticCache does in the torch
step; `keys="prompt"` attends over the prompt's own n keys instead (less work than the torch step). JaxDecode: one greedy decode step of one
token at a traced position, attending over the whole static cache (masked past the position, as
HF's StaticCache does), the cache donated so XLA updates it in place; the token stays on the
device from step to step. `hlo_text()` gives the optimized HLO for comparison with ours
(`options={"xla_dump_to": dir, "xla_dump_hlo_as_text": True}` dumps our optimized HLO).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np
import torch


def available() -> bool:
    try:
        import jax  # noqa: F401
    except Exception:  # noqa: BLE001 - any import problem: no reference in this run
        return False
    return True


class _JaxLlama:
    """What both references share: the model's shapes, its weights as JAX arrays, RoPE's inverse
    frequencies, a zeroed static K/V cache of `cache_len`, and RMSNorm."""

    def __init__(self, model: Any, cache_len: int, precision: str | None) -> None:
        import jax.numpy as jnp

        self.precision = precision
        cfg = model.config
        self.h, self.kvh = cfg.num_attention_heads, cfg.num_key_value_heads
        self.hd = cfg.hidden_size // self.h
        self.eps = cfg.rms_norm_eps
        theta = getattr(cfg, "rope_theta", None) or cfg.rope_parameters["rope_theta"]
        self.inv_freq_np = 1.0 / (theta ** (np.arange(0, self.hd, 2, dtype=np.float32) / self.hd))
        self.weights = {k: jnp.asarray(v.detach().float().numpy()) for k, v in model.state_dict().items()}
        self.layers = cfg.num_hidden_layers
        self.cache_len = cache_len
        self.cache = [jnp.zeros((1, self.kvh, cache_len, self.hd), jnp.float32) for _ in range(2 * self.layers)]

    def _norm(self, x: Any, weight: Any) -> Any:
        import jax
        import jax.numpy as jnp

        return x * jax.lax.rsqrt(jnp.mean(x * x, axis=-1, keepdims=True) + self.eps) * weight

    def _precision(self) -> Any:
        import contextlib

        import jax

        return contextlib.nullcontext() if self.precision is None else jax.default_matmul_precision(self.precision)


class JaxPrefill(_JaxLlama):
    def __init__(self, model: Any, ids: torch.Tensor, cache_len: int, precision: str | None = None,
                 keys: str = "cache") -> None:
        """`precision`: jax.default_matmul_precision for the dots ("highest" = float32, what
        torch_tpu emits by default); None keeps JAX's default. `keys`: "cache" (all `cache_len`,
        masked, like the torch step) or "prompt" (the n new keys only)."""
        import jax
        import jax.numpy as jnp

        super().__init__(model, cache_len, precision)
        if keys not in ("cache", "prompt"):
            raise ValueError(f"keys must be 'cache' or 'prompt', got {keys!r}")
        self.keys = keys
        self.ids = jnp.asarray(ids.numpy())
        n = ids.shape[1]
        freqs = np.outer(np.arange(n, dtype=np.float32), self.inv_freq_np)
        emb = np.concatenate([freqs, freqs], axis=-1)
        self.cos, self.sin = jnp.asarray(np.cos(emb)), jnp.asarray(np.sin(emb))
        self._fn = jax.jit(self._prefill)
        self._jax = jax

    def _prefill(self, w: dict[str, Any], ids: Any, cos: Any, sin: Any, cache: list[Any]) -> tuple[Any, list[Any]]:
        import jax
        import jax.numpy as jnp

        def rope(x: Any) -> Any:
            half = x.shape[-1] // 2
            rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            return x * cos + rot * sin

        n = ids.shape[1]
        x = w["model.embed_tokens.weight"][ids[0]]  # [n, hidden]
        # query i (at position i) sees keys 0..i: of the prompt, or of the whole cache (the rest masked)
        kv_len = n if self.keys == "prompt" else self.cache_len
        mask = jnp.arange(kv_len)[None, :] <= jnp.arange(n)[:, None]
        new_cache = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            y = self._norm(x, w[p + "input_layernorm.weight"])
            q = (y @ w[p + "self_attn.q_proj.weight"].T).reshape(n, self.h, self.hd).transpose(1, 0, 2)
            k = (y @ w[p + "self_attn.k_proj.weight"].T).reshape(n, self.kvh, self.hd).transpose(1, 0, 2)
            v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(n, self.kvh, self.hd).transpose(1, 0, 2)
            q, k = rope(q), rope(k)
            kc = jax.lax.dynamic_update_slice(cache[2 * i], k[None], (0, 0, 0, 0))
            vc = jax.lax.dynamic_update_slice(cache[2 * i + 1], v[None], (0, 0, 0, 0))
            new_cache += [kc, vc]
            rep = self.h // self.kvh
            ka, va = (k, v) if self.keys == "prompt" else (kc[0], vc[0])
            kk, vv = jnp.repeat(ka, rep, axis=0), jnp.repeat(va, rep, axis=0)
            s = jnp.einsum("hqd,hkd->hqk", q, kk) / np.sqrt(self.hd)
            s = jnp.where(mask, s, -jnp.inf)
            a = jax.nn.softmax(s, axis=-1)
            o = jnp.einsum("hqk,hkd->hqd", a, vv).transpose(1, 0, 2).reshape(n, self.h * self.hd)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            y = self._norm(x, w[p + "post_attention_layernorm.weight"])
            g = y @ w[p + "mlp.gate_proj.weight"].T
            u = y @ w[p + "mlp.up_proj.weight"].T
            x = x + (jax.nn.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = self._norm(x[-1:], w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        logits = x @ head.T
        return jnp.argmax(logits, axis=-1), new_cache

    def run(self) -> int:
        with self._precision():
            tok, cache = self._fn(self.weights, self.ids, self.cos, self.sin, self.cache)
        self._jax.block_until_ready((tok, cache))
        self.filled_cache = cache  # the prompt's K/V: JaxDecode continues from it
        return int(tok[0])

    def timed(self, what: str = "prefill") -> float:
        t0 = time.perf_counter()
        self.run()
        return time.perf_counter() - t0

    def hlo_text(self) -> str:
        with self._precision():
            lowered = self._fn.lower(self.weights, self.ids, self.cos, self.sin, self.cache)
            return lowered.compile().as_text()


class JaxDecode(_JaxLlama):
    """Greedy decode steps after a prompt, on a static KV cache of `cache_len` (see module doc)."""

    def __init__(self, model: Any, cache_len: int, precision: str | None = None) -> None:
        import jax
        import jax.numpy as jnp

        super().__init__(model, cache_len, precision)
        self.inv_freq = jnp.asarray(self.inv_freq_np)
        self._fn = jax.jit(self._step, donate_argnums=(4,))
        self._jax = jax

    def _step(self, w: dict[str, Any], tok: Any, pos: Any, inv_freq: Any, cache: list[Any]) -> tuple[Any, list[Any]]:
        import jax
        import jax.numpy as jnp

        freqs = pos.astype(jnp.float32) * inv_freq
        emb = jnp.concatenate([freqs, freqs])
        cos, sin = jnp.cos(emb), jnp.sin(emb)

        def rope(x: Any) -> Any:
            half = x.shape[-1] // 2
            rot = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
            return x * cos + rot * sin

        x = w["model.embed_tokens.weight"][tok[0]]  # [1, hidden]
        valid = jnp.arange(self.cache_len) <= pos  # [cache_len]
        rep = self.h // self.kvh
        new_cache = []
        for i in range(self.layers):
            p = f"model.layers.{i}."
            y = self._norm(x, w[p + "input_layernorm.weight"])
            q = rope((y @ w[p + "self_attn.q_proj.weight"].T).reshape(self.h, self.hd))
            k = rope((y @ w[p + "self_attn.k_proj.weight"].T).reshape(self.kvh, self.hd))
            v = (y @ w[p + "self_attn.v_proj.weight"].T).reshape(self.kvh, self.hd)
            kc = jax.lax.dynamic_update_slice(cache[2 * i], k[None, :, None, :], (0, 0, pos, 0))
            vc = jax.lax.dynamic_update_slice(cache[2 * i + 1], v[None, :, None, :], (0, 0, pos, 0))
            new_cache += [kc, vc]
            qg = q.reshape(self.kvh, rep, self.hd)  # GQA: query heads grouped by their KV head
            s = jnp.einsum("grd,gkd->grk", qg, kc[0]) / np.sqrt(self.hd)
            a = jax.nn.softmax(jnp.where(valid, s, -jnp.inf), axis=-1)
            o = jnp.einsum("grk,gkd->grd", a, vc[0]).reshape(1, self.h * self.hd)
            x = x + o @ w[p + "self_attn.o_proj.weight"].T
            y = self._norm(x, w[p + "post_attention_layernorm.weight"])
            g = y @ w[p + "mlp.gate_proj.weight"].T
            u = y @ w[p + "mlp.up_proj.weight"].T
            x = x + (jax.nn.silu(g) * u) @ w[p + "mlp.down_proj.weight"].T
        x = self._norm(x, w["model.norm.weight"])
        head = w.get("lm_head.weight", w["model.embed_tokens.weight"])
        return jnp.argmax(x @ head.T, axis=-1).astype(jnp.int32)[None], new_cache  # [1, 1]

    def decode(self, first: int, start: int, n: int) -> list[Any]:
        """n greedy steps from token `first` at position `start` (positions uploaded before the
        first step, as the torch variants hold theirs); one host sync at the end."""
        import jax.numpy as jnp

        positions = [jnp.int32(start + i) for i in range(n)]
        tok = jnp.asarray([[first]], jnp.int32)
        toks = []
        with self._precision():
            for pos in positions:
                tok, self.cache = self._fn(self.weights, tok, pos, self.inv_freq, self.cache)
                toks.append(tok)
        self._jax.block_until_ready((tok, self.cache))
        return toks

    def tokens(self, first: int, start: int, n: int) -> list[int]:
        return [int(t[0, 0]) for t in self.decode(first, start, n)]

    def timed(self, first: int, start: int, n: int) -> float:
        t0 = time.perf_counter()
        self.decode(first, start, n)
        return time.perf_counter() - t0

    def hlo_text(self) -> str:
        import jax.numpy as jnp

        with self._precision():
            lowered = self._fn.lower(self.weights, jnp.zeros((1, 1), jnp.int32), jnp.int32(0), self.inv_freq,
                                     self.cache)
            return lowered.compile().as_text()
