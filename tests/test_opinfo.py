"""OpInfo conformance: every op in PyTorch's own `op_db`, on tpu vs the CPU reference.

For each OpInfo and each swept dtype the op supports on CPU, every sample from
`op.sample_inputs("cpu", dtype)` runs on CPU and (with all tensors moved) on tpu; outputs (and
any inputs the op mutated) are compared with `torch.testing.assert_close` (equal_nan=True) and
must live on tpu. Per (op, dtype) we record samples run / passed / lowered (a sample is
"lowered" when no ATen op of it ran on the CPU fallback). Samples whose CPU reference raises are
not counted. Random ops (and samples with dropout) compare only shape/dtype/device.

Details of the comparison:
  - tolerances by result dtype: float32/float64 assert_close defaults, bf16/f16 rtol=atol=2e-2,
    integers and bool exact; `sample.output_process_fn_grad` is applied to both results (it
    removes e.g. the sign ambiguity of singular vectors);
  - a float sample that mismatches still passes when the tpu result matches the op computed in
    float64 on CPU (cast to the result dtype) within the same tolerance: tpu is right and the
    low-precision CPU reference is not (e.g. addbmm accumulating in bf16);
  - sort/argsort (stable=False) and topk may order the indices of equal values differently:
    distinct indices that gather the CPU's values pass;
  - views in a sample stay views on tpu (their base moves once, the view is rebuilt with the
    same sizes/strides/offset), so storage-dependent ops (as_strided) and aliasing are tested.

The test for an op fails when any (op, dtype) not listed in tests/opinfo_skips.py has a sample
that mismatches or raises on tpu.

Three kinds of checks, each recorded per (op, dtype) and summarised separately:
  forward: the op's values (above);
  inplace: `op.inplace_variant` (e.g. Tensor.add_) on a clone of the sample's input: the result
      and the mutated input must match (samples whose CPU in-place call raises, e.g. a
      broadcasting input, are not counted);
  grad (test_opinfo_grad): for OpInfos with supports_autograd, samples with requires_grad on the
      float tensors run forward on CPU and on tpu (same values), then `torch.autograd.grad` of
      every differentiable output with the same random grad_output (a fixed seeded tensor per
      output; equivalent to backpropagating sum(out_i * w_i)); every input gradient is compared
      with the CPU's (same dtype-aware tolerances and float64 re-check as forward). A sample is
      "lowered" when no ATen op ran on the CPU fallback during the backward pass (forward
      fallbacks are counted separately). Random ops are not swept.

Modes:
  default (`make test`): at most 3 samples per (op, dtype); dtypes float32, bfloat16, int64
      (or the first other swept dtype when the op supports none of those). In-place checks:
      float32 only, the first 2 samples. Gradients: float32 only, at most
      TORCH_TPU_OPINFO_GRAD_SAMPLES (2) samples per op. Coverage is capped by sample counts, never
      by wall time, so a slow machine runs exactly the same checks.
  full (`TORCH_TPU_CONFORMANCE=full`, `make conformance`): every sample of every dtype in
      (float32, bfloat16, float16, float64, int32, int64, bool); in-place on every swept dtype;
      gradients in float32, bfloat16, float16 and float64.
TORCH_TPU_OPINFO_OPS=name1,name2 restricts the sweep to those OpInfo keys (debugging);
TORCH_TPU_OPINFO_DTYPES=float32,bfloat16 restricts the dtypes; TORCH_TPU_OPINFO_KINDS=grad (any of
forward,inplace,grad) restricts the kinds of checks (in default mode, a TORCH_TPU_OPINFO_DTYPES
selection also picks the gradient dtypes). TORCH_TPU_OPINFO_DETAILS=path dumps every record;
TORCH_TPU_OPINFO_MERGE_DETAILS=a.json,b.json merges such dumps of other runs into the summary.

The summary goes to benchmarks/results/local/ (ignored by git); TORCH_TPU_OPINFO_SUMMARY=path
writes it elsewhere (`make conformance` refreshes the tracked benchmarks/results/opinfo_summary.json).
The whole sweep runs in this one process: the runtime evicts least-recently-used executables, so
thousands of distinct programs stay within the process's memory maps.

"""

from __future__ import annotations

import json
import math
import os
import re
import sys
import time
import warnings
import zlib
from collections import Counter
from pathlib import Path

import pytest
import torch
import torch_tpu
from torch.testing._internal.common_methods_invocations import op_db

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from opinfo_no_stack_walk import install as _no_stack_walk  # noqa: E402
from opinfo_skips import GRAD_SKIPS, HARD_SKIPS, INPLACE_SKIPS, SKIPS  # noqa: E402

_no_stack_walk()

DEV = "tpu"
FULL = os.environ.get("TORCH_TPU_CONFORMANCE", "").strip().lower() == "full"
ALL_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.bool,
)
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.int64)
# Default mode: float32 gradients only, unless TORCH_TPU_OPINFO_DTYPES asks for others.
GRAD_DTYPES = (torch.float32, torch.bfloat16, torch.float16, torch.float64) \
    if FULL or os.environ.get("TORCH_TPU_OPINFO_DTYPES") else (torch.float32,)
INPLACE_DTYPES = ALL_DTYPES if FULL else (torch.float32,)
MAX_SAMPLES = None if FULL else 3
GRAD_MAX_SAMPLES = None if FULL else int(os.environ.get("TORCH_TPU_OPINFO_GRAD_SAMPLES", "2"))
INPLACE_MAX_SAMPLES = None if FULL else 2
_RESULTS_DIR = Path(__file__).resolve().parent.parent / "benchmarks" / "results"
SUMMARY_PATH = Path(os.environ.get("TORCH_TPU_OPINFO_SUMMARY") or _RESULTS_DIR / "local" / "opinfo_summary.json")
PASS_AND_LOWERED_THRESHOLD = 0.98

# Tolerances by the dtype of the compared tensor: (rtol, atol). float32/float64 are
# assert_close's defaults; half types are loose (inputs of the reference and of tpu both go
# through f32 opmath, then round, so 1-2 ulp of bf16/f16 differences are expected).
TOL = {
    torch.float32: (1.3e-6, 1e-5),
    torch.complex64: (1.3e-6, 1e-5),
    torch.float64: (1e-7, 1e-7),
    torch.complex128: (1e-7, 1e-7),
    torch.bfloat16: (2e-2, 2e-2),
    torch.float16: (2e-2, 2e-2),
}

# Float dtypes whose mismatches are re-checked against a float64 computation of the op.
HP_DTYPES = (torch.float32, torch.bfloat16, torch.float16)

# Ops whose values are random (or uninitialised): only shape/dtype/device are compared.
RANDOM_OPS = {
    "bernoulli", "cauchy", "exponential", "geometric", "log_normal", "normal", "normal.in_place",
    "normal.number_mean", "uniform", "multinomial", "randn", "randn_like", "rand_like", "randint",
    "randint_like", "nn.functional.rrelu", "svd_lowrank", "pca_lowrank", "nn.functional.dropout",
    "nn.functional.dropout2d", "nn.functional.dropout3d", "nn.functional.alpha_dropout",
    "nn.functional.feature_alpha_dropout.with_train", "nn.functional.fractional_max_pool2d",
    "nn.functional.fractional_max_pool3d",
}
_RANDOM_RE = re.compile(r"(^|\.)(rand[a-z_]*|bernoulli|multinomial|[a-z_]*dropout[a-z0-9_]*)$")


def _key(op) -> str:
    return op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")


def _is_random(op) -> bool:
    key = _key(op)
    if op.has_nondeterministic_output or key in RANDOM_OPS:
        return True
    return bool(_RANDOM_RE.search(op.name)) and "without_train" not in key and "backward" not in key


def _dstr(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sweep_dtypes(op) -> list[torch.dtype]:
    try:
        supported = op.supported_dtypes("cpu")
    except Exception:
        return []
    if FULL:
        return [d for d in ALL_DTYPES if d in supported and _dtype_ok(d)]
    picked = [d for d in DEFAULT_DTYPES if d in supported]
    if not picked:  # bool-only (or f64/f16/i32-only) ops: take the first one we sweep
        picked = [d for d in (torch.bool, *ALL_DTYPES) if d in supported][:1]
    return [d for d in picked if _dtype_ok(d)]


def _env_set(name: str) -> set[str]:
    return {s.strip() for s in os.environ.get(name, "").split(",") if s.strip()}


_SELECT = _env_set("TORCH_TPU_OPINFO_OPS")
_DTYPE_SELECT = _env_set("TORCH_TPU_OPINFO_DTYPES")
KINDS = _env_set("TORCH_TPU_OPINFO_KINDS") or {"forward", "inplace", "grad"}
OPS = [op for op in op_db if not _SELECT or _key(op) in _SELECT]
GRAD_OPS = [op for op in OPS if op.supports_autograd]


def _dtype_ok(dtype: torch.dtype) -> bool:
    return not _DTYPE_SELECT or _dstr(dtype) in _DTYPE_SELECT


def _grad_dtypes(op) -> list[torch.dtype]:
    if not op.supports_autograd or _is_random(op):
        return []
    try:
        supported = op.supported_backward_dtypes("cpu")
    except Exception:
        return []
    return [d for d in GRAD_DTYPES if d in supported and _dtype_ok(d)]

# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------

# (kind, opinfo key, dtype str) -> record; kind is "forward", "inplace" or "grad".
RESULTS: dict[tuple[str, str, str], dict] = {}
_STATE = {"start": None, "ops_run": 0, "grad_start": None, "grad_ops_run": 0}

_COUNTER_FIELDS = ("fallback_ops", "fwd_fallback_ops")


def _call_on_tpu(fn: object, *args: object, **kwargs: object) -> tuple[object, Exception | None]:
    """Runs `fn` on tpu inputs (fallback counters reset first) and waits for it; returns
    (result, None) or (None, the exception): a lowering must fall back, never raise."""
    torch_tpu.reset_fallback_stats()
    try:
        actual = fn(*args, **kwargs)  # type: ignore[operator]
        torch_tpu.synchronize()
        return actual, None
    except Exception as err:
        return None, err


def _record_fallbacks(rec: dict) -> bool:
    """Moves the CPU fallbacks since the last reset into `rec`; True when there were none."""
    fallbacks = torch_tpu.fallback_stats()
    torch_tpu.reset_fallback_stats()
    rec["fallback_ops"].update(fallbacks)
    rec["lowered"] += not fallbacks
    return not fallbacks


def _record(key: str, dtype: torch.dtype, kind: str = "forward") -> dict:
    rec = RESULTS.setdefault(
        (kind, key, _dstr(dtype)),
        {
            "run": 0,  # samples whose CPU reference ran
            "passed": 0,
            "lowered": 0,  # samples with no CPU fallback (grad: none during the backward pass)
            "passed_lowered": 0,
            "cpu_ref_errors": 0,
            "fallback_ops": Counter(),  # grad: fallbacks during the backward pass
            "failures": [],
            "passed_by_tie_or_f64_ref": 0,  # passed only via _ties_ok / _matches_higher_precision
            "sample_gen_error": None,
        },
    )
    if kind == "grad":
        rec.setdefault("fwd_fallback_ops", Counter())  # fallbacks of the forward pass
        rec.setdefault("passed_lowered_fwd_bwd", 0)  # passed with no fallback in forward nor backward
        rec.setdefault("no_differentiable_output", 0)  # samples not counted: nothing to differentiate
    return rec


# ---------------------------------------------------------------------------------------------
# Moving and comparing
# ---------------------------------------------------------------------------------------------


def _to_tpu(x, memo: dict | None = None):
    """Moves every tensor of a sample to tpu. A view keeps its view-ness: its base moves once
    (shared by all views of it in the sample, so aliasing survives) and the view is rebuilt with
    the same sizes/strides/storage offset (ops like as_strided depend on the whole storage)."""
    memo = {} if memo is None else memo
    if isinstance(x, str) and x == "cpu":  # e.g. Tensor.to(x, "cpu", ...): target tpu instead
        return DEV
    if isinstance(x, torch.Tensor):
        if ("t", id(x)) in memo:  # one tensor passed twice stays one tensor
            return memo[("t", id(x))]
        with torch.no_grad():
            t = _view_to_tpu(x, memo)
            if t is None:
                t = x.detach().to(DEV)
        if x.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
        memo[("t", id(x))] = t
        return t
    if isinstance(x, torch.device) and x.type == "cpu":
        return torch.device(DEV)
    if isinstance(x, list):
        return [_to_tpu(v, memo) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_to_tpu(v, memo) for v in x)
    if isinstance(x, dict):
        return {k: _to_tpu(v, memo) for k, v in x.items()}
    return x


def _view_to_tpu(x: torch.Tensor, memo: dict) -> torch.Tensor | None:
    base = x._base
    if base is None or x.layout != torch.strided or base.layout != torch.strided:
        return None
    if not base.is_contiguous() or base.storage_offset() != 0 or x.dtype != base.dtype:
        return None
    if base.untyped_storage().nbytes() != base.numel() * base.element_size():
        return None
    tb = memo.get(id(base))
    if tb is None:
        tb = memo[id(base)] = base.detach().to(DEV)
    return tb.as_strided(x.size(), x.stride(), x.storage_offset())


# Tensor arguments PyTorch requires on the CPU (positional index into sample.args).
CPU_ONLY_ARGS = {"tensor_split": 0}


def _tpu_sample(key: str, sample):
    memo: dict = {}
    inp, args, kwargs = _to_tpu(sample.input, memo), _to_tpu(sample.args, memo), _to_tpu(sample.kwargs, memo)
    if key in CPU_ONLY_ARGS and len(sample.args) > CPU_ONLY_ARGS[key]:
        i = CPU_ONLY_ARGS[key]
        args = (*args[:i], sample.args[i].clone() if isinstance(sample.args[i], torch.Tensor) else sample.args[i],
                *args[i + 1:])
    return inp, args, kwargs


def _on_device(x) -> bool:
    """Whether a moved sample reaches tpu at all (a tensor or a device argument)."""
    if isinstance(x, torch.Tensor):
        return x.device.type == DEV
    if isinstance(x, torch.device) or (isinstance(x, str) and x == DEV):
        return x == DEV or getattr(x, "type", None) == DEV
    if isinstance(x, (list, tuple)):
        return any(_on_device(v) for v in x)
    if isinstance(x, dict):
        return any(_on_device(v) for v in x.values())
    return False


def _sample_is_random(key: str, sample) -> bool:
    """Samples of deterministic ops that still draw random numbers (dropout inside attention)."""
    kw = sample.kwargs
    if isinstance(kw.get("dropout_p"), float) and kw["dropout_p"] > 0:
        return True
    return key == "nn.functional.multi_head_attention_forward" and bool(kw.get("training"))


def _upcast(x):
    """A float64 copy of a sample's floating tensors (the higher-precision reference)."""
    if isinstance(x, torch.Tensor):
        return x.detach().to(torch.float64) if x.is_floating_point() else x.detach().clone()
    if isinstance(x, list):
        return [_upcast(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_upcast(v) for v in x)
    if isinstance(x, dict):
        return {k: _upcast(v) for k, v in x.items()}
    return x


def _cast_like(ref, like):
    """`ref` (float64 results) cast leaf by leaf to the dtypes of `like` (the CPU results)."""
    if isinstance(ref, torch.Tensor) and isinstance(like, torch.Tensor):
        return ref.to(like.dtype) if ref.shape == like.shape else ref
    if isinstance(ref, (list, tuple)) and isinstance(like, (list, tuple)) and len(ref) == len(like):
        return [_cast_like(r, v) for r, v in zip(ref, like, strict=True)]
    if isinstance(ref, float) and isinstance(like, float):
        return ref
    return ref


def _tensors(x) -> list[torch.Tensor]:
    if isinstance(x, torch.Tensor):
        return [x]
    if isinstance(x, (list, tuple)):
        return [t for v in x for t in _tensors(v)]
    if isinstance(x, dict):
        return [t for v in x.values() for t in _tensors(v)]
    return []


class Mismatch(AssertionError):
    pass


def _tol(dtype: torch.dtype) -> tuple[float, float]:
    return TOL.get(dtype, (0.0, 0.0))


def _compare(actual, expected, path: str, random: bool, sample_dtype: torch.dtype, check_device=True) -> None:
    if isinstance(expected, torch.Tensor):
        if not isinstance(actual, torch.Tensor):
            raise Mismatch(f"{path}: expected a Tensor, got {type(actual).__name__}")
        if check_device and expected.device.type == "cpu" and actual.device.type != DEV:
            raise Mismatch(f"{path}: result on {actual.device}, expected {DEV}")
        with torch.no_grad():
            a = actual.detach().to("cpu")
        e = expected.detach()
        if a.dtype != e.dtype or a.shape != e.shape:
            raise Mismatch(f"{path}: got {a.dtype}{list(a.shape)}, expected {e.dtype}{list(e.shape)}")
        if random:
            return
        rtol, atol = _tol(e.dtype)
        try:
            torch.testing.assert_close(a, e, rtol=rtol, atol=atol, equal_nan=True, check_device=False,
                                       check_stride=False, check_layout=False)
        except AssertionError as err:
            raise Mismatch(f"{path}: {err}") from None
        return
    if isinstance(expected, (list, tuple)):
        if not isinstance(actual, (list, tuple)) or len(actual) != len(expected):
            raise Mismatch(f"{path}: expected a sequence of {len(expected)}, got {type(actual).__name__}")
        for i, (a, e) in enumerate(zip(actual, expected, strict=True)):
            _compare(a, e, f"{path}[{i}]", random, sample_dtype, check_device)
        return
    if isinstance(expected, dict):
        if not isinstance(actual, dict) or actual.keys() != expected.keys():
            raise Mismatch(f"{path}: dict keys differ")
        for k in expected:
            _compare(actual[k], expected[k], f"{path}[{k!r}]", random, sample_dtype, check_device)
        return
    if random:
        return
    if isinstance(expected, float) and isinstance(actual, (float, int)):
        if math.isnan(expected) and math.isnan(actual):
            return
        rtol, atol = _tol(sample_dtype if sample_dtype.is_floating_point else torch.float64)
        if not (actual == expected or abs(actual - expected) <= atol + rtol * abs(expected)):
            raise Mismatch(f"{path}: got {actual!r}, expected {expected!r}")
        return
    if isinstance(expected, torch.device) or isinstance(actual, torch.device):
        return  # `x.device` style results: the device differs by construction
    if actual != expected:
        raise Mismatch(f"{path}: got {actual!r}, expected {expected!r}")


def _short(err: BaseException, limit: int = 600) -> str:
    s = f"{type(err).__name__}: {err}".strip()
    return s if len(s) <= limit else s[:limit] + " ..."


def _run_sample(op, sample, rec: dict, random: bool, dtype: torch.dtype) -> None:
    run_before = rec["run"]
    try:
        _run_sample_inner(op, sample, rec, random, dtype)
    except Exception as err:  # moving the sample (or this harness) failed: count as a failure
        rec["run"] = run_before + 1
        rec["failures"].append(f"harness error: {_short(err)}")


def _run_sample_inner(op, sample, rec: dict, random: bool, dtype: torch.dtype) -> None:
    key = _key(op)
    random = random or _sample_is_random(key, sample)
    tpu_input, tpu_args, tpu_kwargs = _tpu_sample(key, sample)
    if not _on_device((tpu_input, tpu_args, tpu_kwargs)):
        # e.g. arange(2): no tensor and no device argument, so nothing runs on tpu: not counted
        rec["not_on_device"] = rec.get("not_on_device", 0) + 1
        return
    # Pristine float64 copy for the higher-precision check (the CPU run may mutate `sample`).
    hp = (_upcast(sample.input), _upcast(sample.args), _upcast(sample.kwargs)) \
        if dtype in HP_DTYPES and not random else None
    pristine_input = _upcast(sample.input) if key in TIE_INDEX_OPS or key in TIE_PICK_OPS else None
    try:
        expected = op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        rec["cpu_ref_errors"] += 1
        return
    rec["run"] += 1
    actual, error = _call_on_tpu(op, tpu_input, *tpu_args, **tpu_kwargs)
    lowered = _record_fallbacks(rec)
    desc = f"sample {rec['run'] - 1} ({_describe(sample)})"
    if error is not None:
        rec["failures"].append(f"{desc}: tpu raised {_short(error)}")
        return
    proc = sample.output_process_fn_grad
    cpu_in = _tensors((sample.input, sample.args, sample.kwargs))
    tpu_in = _tensors((tpu_input, tpu_args, tpu_kwargs))

    def check(exp_out, exp_in) -> None:
        _compare(proc(actual), exp_out, "out", random, dtype)
        if not random:  # inputs the op mutated must match too
            _compare(tpu_in, exp_in, "input-after-op", random, dtype, check_device=False)

    try:
        check(proc(expected), cpu_in)
    except Exception as err:
        if not (_ties_ok(key, sample, pristine_input, actual, expected, dtype)
                or _matches_higher_precision(op, hp, proc, expected, cpu_in, check)):
            rec["failures"].append(f"{desc}: {_short(err)}")
            return
        rec["passed_by_tie_or_f64_ref"] += 1
    rec["passed"] += 1
    rec["passed_lowered"] += lowered


def _matches_higher_precision(op, hp, proc, expected, cpu_in, check) -> bool:
    """True when the tpu result matches the op computed in float64 (cast to the result dtypes)
    within the dtype's tolerance: tpu is right and the CPU's low-precision reference is not."""
    if hp is None:
        return False
    hp_input, hp_args, hp_kwargs = hp
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = op(hp_input, *hp_args, **hp_kwargs)
        ref_out = _cast_like(proc(ref), proc(expected))
        ref_in = _cast_like(_tensors((hp_input, hp_args, hp_kwargs)), cpu_in)
        check(ref_out, ref_in)
    except Exception:
        return False
    return True


def _clone(x):
    """A structural copy of a sample's tensors (fresh storages, same values, no autograd)."""
    if isinstance(x, torch.Tensor):
        return x.detach().clone()
    if isinstance(x, list):
        return [_clone(v) for v in x]
    if isinstance(x, tuple) and not hasattr(x, "_fields"):
        return tuple(_clone(v) for v in x)
    if isinstance(x, dict):
        return {k: _clone(v) for k, v in x.items()}
    return x


def _run_inplace_sample(op, sample, rec: dict, random: bool, dtype: torch.dtype) -> None:
    """`op.inplace_variant` on clones of the sample: the returned value and every tensor
    argument after the call (the mutated input) must match the CPU."""
    key = _key(op)
    random = random or _sample_is_random(key, sample)
    fn = op.inplace_variant
    cpu_input, cpu_args, cpu_kwargs = _clone(sample.input), _clone(sample.args), _clone(sample.kwargs)
    if not isinstance(cpu_input, torch.Tensor):
        return
    tpu_input, tpu_args, tpu_kwargs = _tpu_sample(key, type(sample)(cpu_input, args=cpu_args, kwargs=cpu_kwargs))
    hp = (_upcast(cpu_input), _upcast(cpu_args), _upcast(cpu_kwargs)) \
        if dtype in HP_DTYPES and not random else None
    try:
        expected = fn(cpu_input, *cpu_args, **cpu_kwargs)
    except Exception:  # e.g. the result would need a broadcast or a dtype the input cannot hold
        rec["cpu_ref_errors"] += 1
        return
    rec["run"] += 1
    actual, error = _call_on_tpu(fn, tpu_input, *tpu_args, **tpu_kwargs)
    lowered = _record_fallbacks(rec)
    desc = f"inplace sample {rec['run'] - 1} ({_describe(sample)})"
    if error is not None:
        rec["failures"].append(f"{desc}: tpu raised {_short(error)}")
        return
    cpu_in = _tensors((cpu_input, cpu_args, cpu_kwargs))
    tpu_in = _tensors((tpu_input, tpu_args, tpu_kwargs))

    def check(exp_out, exp_in) -> None:
        _compare(actual, exp_out, "out", random, dtype)
        if not random:
            _compare(tpu_in, exp_in, "input-after-op", random, dtype, check_device=False)

    try:
        check(expected, cpu_in)
    except Exception as err:
        if not _inplace_matches_higher_precision(fn, hp, expected, cpu_in, check):
            rec["failures"].append(f"{desc}: {_short(err)}")
            return
        rec["passed_by_tie_or_f64_ref"] += 1
    rec["passed"] += 1
    rec["passed_lowered"] += lowered


def _inplace_matches_higher_precision(fn, hp, expected, cpu_in, check) -> bool:
    if hp is None:
        return False
    hp_input, hp_args, hp_kwargs = hp
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            ref = fn(hp_input, *hp_args, **hp_kwargs)
        check(_cast_like(ref, expected), _cast_like(_tensors((hp_input, hp_args, hp_kwargs)), cpu_in))
    except Exception:
        return False
    return True


def _grad_weights(outs: list[torch.Tensor], seed: int) -> list[torch.Tensor]:
    """The fixed random grad_output of each differentiable output (CPU tensors)."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.dtype) for o in outs]


def _diff_outputs(out) -> list[torch.Tensor]:
    return [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]


def _grads(op, inp, args, kwargs, leaf_idx: list[int], weights: list[torch.Tensor] | None, seed: int,
           proc) -> tuple[list, list[torch.Tensor]]:
    """Runs the op (through its gradcheck wrapper) and returns (input gradients, weights)."""
    leaves = _tensors((inp, args, kwargs))
    leaves = [leaves[i] for i in leaf_idx]
    out = op.gradcheck_wrapper(op, inp, *args, **kwargs)
    outs = _diff_outputs(proc(out))
    if weights is None:
        weights = _grad_weights(outs, seed)
    if len(outs) != len(weights):
        raise Mismatch(f"{len(outs)} differentiable outputs, expected {len(weights)}")
    dev = leaves[0].device
    ws = [w.to(dev) for w in weights]
    return list(torch.autograd.grad(outs, leaves, ws, allow_unused=True)), weights


def _run_grad_sample(op, sample, rec: dict, dtype: torch.dtype, seed: int) -> None:
    run_before = rec["run"]
    try:
        _run_grad_sample_inner(op, sample, rec, dtype, seed)
    except Exception as err:
        rec["run"] = run_before + 1
        rec["failures"].append(f"harness error: {_short(err)}")


def _run_grad_sample_inner(op, sample, rec: dict, dtype: torch.dtype, seed: int) -> None:
    key = _key(op)
    if _sample_is_random(key, sample):
        return
    cpu_all = _tensors((sample.input, sample.args, sample.kwargs))
    leaf_idx = [i for i, t in enumerate(cpu_all) if t.requires_grad and t.is_floating_point()]
    if not leaf_idx:
        rec["no_differentiable_output"] += 1
        return
    tpu_input, tpu_args, tpu_kwargs = _tpu_sample(key, sample)
    hp = (_upcast(sample.input), _upcast(sample.args), _upcast(sample.kwargs)) if dtype in HP_DTYPES else None
    proc = sample.output_process_fn_grad
    try:
        with torch.enable_grad():
            expected, weights = _grads(op, sample.input, sample.args, sample.kwargs, leaf_idx, None, seed, proc)
    except Exception:
        rec["cpu_ref_errors"] += 1
        return
    if not weights:
        rec["no_differentiable_output"] += 1
        return
    rec["run"] += 1
    desc = f"grad sample {rec['run'] - 1} ({_describe(sample)})"
    tpu_leaves = [_tensors((tpu_input, tpu_args, tpu_kwargs))[i] for i in leaf_idx]
    if not all(t.requires_grad for t in tpu_leaves):
        rec["failures"].append(f"{desc}: harness could not make every differentiable input require grad")
        return
    torch_tpu.reset_fallback_stats()
    error = None
    try:
        with torch.enable_grad():
            out = op.gradcheck_wrapper(op, tpu_input, *tpu_args, **tpu_kwargs)
            outs = _diff_outputs(proc(out))
            torch_tpu.synchronize()
            fwd_fallbacks = torch_tpu.fallback_stats()
            ws = [w.to(DEV) for w in weights]
            torch_tpu.reset_fallback_stats()
            if len(outs) != len(ws):
                raise Mismatch(f"{len(outs)} differentiable outputs on tpu, expected {len(ws)}")
            actual = list(torch.autograd.grad(outs, tpu_leaves, ws, allow_unused=True))
            torch_tpu.synchronize()
    except Exception as err:
        error = err
        fwd_fallbacks = locals().get("fwd_fallbacks", {})
    lowered = _record_fallbacks(rec)
    rec["fwd_fallback_ops"].update(fwd_fallbacks)
    if error is not None:
        rec["failures"].append(f"{desc}: tpu raised {_short(error)}")
        return

    def check(exp) -> None:
        for i, (a, e) in enumerate(zip(actual, exp, strict=True)):
            if e is None and a is not None:
                if bool((a.detach().cpu() == 0).all()):
                    continue
                raise Mismatch(f"grad[{i}]: expected no gradient (unused input), got a non-zero one")
            if e is not None and a is None:
                if bool((e == 0).all()):
                    continue
                raise Mismatch(f"grad[{i}]: no gradient on tpu, expected one")
            if e is not None:
                _compare(a, e, f"grad[{i}]", False, dtype)

    try:
        check(expected)
    except Exception as err:
        if not _grad_matches_higher_precision(op, hp, leaf_idx, weights, seed, proc, expected, check):
            rec["failures"].append(f"{desc}: {_short(err)}")
            return
        rec["passed_by_tie_or_f64_ref"] += 1
    rec["passed"] += 1
    rec["passed_lowered"] += lowered
    rec["passed_lowered_fwd_bwd"] += lowered and not fwd_fallbacks


def _grad_matches_higher_precision(op, hp, leaf_idx, weights, seed, proc, expected, check) -> bool:
    """The tpu gradients match the gradients computed in float64 (cast to the CPU's dtypes)."""
    if hp is None:
        return False
    hp_input, hp_args, hp_kwargs = hp
    try:
        leaves = _tensors((hp_input, hp_args, hp_kwargs))
        for i in leaf_idx:
            leaves[i].requires_grad_(True)
        with warnings.catch_warnings(), torch.enable_grad():
            warnings.simplefilter("ignore")
            ref, _ = _grads(op, hp_input, hp_args, hp_kwargs, leaf_idx, [w.double() for w in weights],
                            seed, proc)
        check([r if r is None or e is None else r.to(e.dtype) for r, e in zip(ref, expected, strict=True)])
    except Exception:
        return False
    return True


# Ops that return indices of equal values in an order PyTorch leaves unspecified
# (sort/argsort with stable=False, topk): index ties are accepted when the indices are a valid
# choice, i.e. distinct and gathering the input at them gives the CPU's values.
TIE_INDEX_OPS = {"sort": 0, "argsort": 0, "topk": 1}  # positional index of `dim` in sample.args
# Reductions to one (value, index) per row whose index among equal values is "device-specific"
# (PyTorch's docs for median/kthvalue; mode's CPU kernel takes it from an unstable std::sort of
# the slice): accepted when x at the index is the CPU's value.
TIE_PICK_OPS = {"median": 0, "nanmedian": 0, "kthvalue": 1, "mode": 0}


def _pick_ties_ok(key, sample, x, actual, expected, dtype) -> bool:
    try:
        _compare(actual[0], expected[0], "values", False, dtype)
        i = TIE_PICK_OPS[key]
        dim = sample.kwargs.get("dim", sample.args[i] if len(sample.args) > i else -1)
        keep = sample.kwargs.get("keepdim", sample.args[i + 1] if len(sample.args) > i + 1 else False)
        idx = actual[1].cpu()
        if idx.shape != expected[1].shape or idx.dtype != expected[1].dtype:
            return False
        if x.dim() == 0:
            return bool((idx == expected[1]).all())
        # x is the float64 copy of the input (exact): back to the output's dtype to compare.
        picked = x.gather(dim, idx if keep else idx.unsqueeze(dim)).to(expected[0].dtype)
        torch.testing.assert_close(picked if keep else picked.squeeze(dim), expected[0], rtol=0, atol=0,
                                   equal_nan=True)
    except Exception:
        return False
    return True


def _ties_ok(key, sample, x, actual, expected, dtype) -> bool:
    if key in TIE_PICK_OPS and x is not None and isinstance(actual, (tuple, list)):
        return _pick_ties_ok(key, sample, x, actual, expected, dtype)
    if key not in TIE_INDEX_OPS or x is None or sample.kwargs.get("stable"):
        return False
    try:
        i = TIE_INDEX_OPS[key]
        dim = sample.kwargs.get("dim", sample.args[i] if len(sample.args) > i else -1)
        if key == "argsort":
            exp_idx, act_idx = expected, actual.cpu()
        else:
            _compare(actual[0], expected[0], "values", False, dtype)
            exp_idx, act_idx = expected[1], actual[1].cpu()
        if x.dim() == 0:
            return bool((act_idx == exp_idx).all())
        if act_idx.shape != exp_idx.shape or act_idx.dtype != exp_idx.dtype:
            return False
        srt = act_idx.sort(dim=dim).values
        if srt.shape[dim] > 1 and not bool((srt.diff(dim=dim) > 0).all()):
            return False  # repeated index
        if bool((act_idx < 0).any()) or bool((act_idx >= x.shape[dim]).any()):
            return False
        torch.testing.assert_close(x.gather(dim, act_idx), x.gather(dim, exp_idx), rtol=0, atol=0,
                                   equal_nan=True)
    except Exception:
        return False
    return True


def _describe(sample) -> str:
    def d(x):
        if isinstance(x, torch.Tensor):
            return f"{_dstr(x.dtype)}{list(x.shape)}" + ("" if x.is_contiguous() else "nc")
        if isinstance(x, (list, tuple)):
            inner = ", ".join(d(v) for v in x[:4]) + (", ..." if len(x) > 4 else "")
            return f"[{inner}]" if isinstance(x, list) else f"({inner})"
        if isinstance(x, dict):
            return "{" + ", ".join(f"{k}={d(v)}" for k, v in x.items()) + "}"
        r = repr(x)
        return r if len(r) < 40 else r[:37] + "..."

    try:
        parts = [d(sample.input)] + [d(a) for a in sample.args] + [f"{k}={d(v)}" for k, v in sample.kwargs.items()]
    except Exception:
        return "?"
    return ", ".join(parts)


def _sweep(op, dtype: torch.dtype, kind: str = "forward") -> dict:
    """Runs the samples of (op, dtype) for `kind` ("forward", which also runs the in-place
    variant when that kind is on, or "grad")."""
    key = _key(op)
    grad = kind == "grad"
    rec = _record(key, dtype, kind)
    inplace_rec = None
    if not grad and "inplace" in KINDS and op.inplace_variant is not None and dtype in INPLACE_DTYPES:
        inplace_rec = _record(key, dtype, "inplace")
    random = _is_random(op)
    seed = zlib.crc32(f"{key}/{dtype}/{kind}".encode())
    torch.manual_seed(zlib.crc32(f"{key}/{dtype}".encode()) if not grad else seed)
    max_samples = GRAD_MAX_SAMPLES if grad else MAX_SAMPLES
    taken = 0
    try:
        samples = iter(op.sample_inputs("cpu", dtype, requires_grad=grad))
    except Exception as err:
        rec["sample_gen_error"] = _short(err, 200)
        return rec
    while max_samples is None or taken < max_samples:
        try:
            sample = next(samples)
        except StopIteration:
            break
        except Exception as err:  # sample generation itself failed: nothing to compare
            rec["sample_gen_error"] = _short(err, 200)
            break
        taken += 1
        if grad:
            _run_grad_sample(op, sample, rec, dtype, seed + taken)
            continue
        if inplace_rec is not None and (INPLACE_MAX_SAMPLES is None or taken <= INPLACE_MAX_SAMPLES):
            try:
                _run_inplace_sample(op, sample, inplace_rec, random, dtype)
            except Exception as err:
                inplace_rec["run"] += 1
                inplace_rec["failures"].append(f"harness error: {_short(err)}")
        if "forward" in KINDS:
            _run_sample(op, sample, rec, random, dtype)
    return rec


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def _kind_summary(kind: str) -> dict:
    per_dtype: dict[str, dict] = {}
    fell_back: dict[str, list[str]] = {}
    aten_fallbacks: Counter = Counter()
    failing: dict[str, str] = {}
    skipped_failing: dict[str, str] = {}
    stale: list[str] = []
    grad = kind == "grad"
    for (k, key, ds), rec in sorted(RESULTS.items()):
        if k != kind or rec["run"] == 0:
            continue
        s = per_dtype.setdefault(ds, {"ops_swept": 0, "ops_ge98_pass_lowered": 0, "ops_all_passing": 0,
                                      "ops_fully_lowered": 0, "samples": 0, "samples_passed": 0,
                                      "samples_lowered": 0, "samples_passed_lowered": 0,
                                      "samples_passed_via_tie_or_f64_ref": 0})
        if grad:
            for f in ("ops_ge98_pass", "ops_ge98_pass_fwd_bwd_lowered", "samples_passed_lowered_fwd_bwd"):
                s.setdefault(f, 0)
            s["ops_ge98_pass"] += rec["passed"] >= PASS_AND_LOWERED_THRESHOLD * rec["run"]
            s["ops_ge98_pass_fwd_bwd_lowered"] += \
                rec["passed_lowered_fwd_bwd"] >= PASS_AND_LOWERED_THRESHOLD * rec["run"]
            s["samples_passed_lowered_fwd_bwd"] += rec["passed_lowered_fwd_bwd"]
        s["ops_swept"] += 1
        s["samples"] += rec["run"]
        s["samples_passed"] += rec["passed"]
        s["samples_lowered"] += rec["lowered"]
        s["samples_passed_lowered"] += rec["passed_lowered"]
        s["samples_passed_via_tie_or_f64_ref"] += rec["passed_by_tie_or_f64_ref"]
        s["ops_ge98_pass_lowered"] += rec["passed_lowered"] >= PASS_AND_LOWERED_THRESHOLD * rec["run"]
        s["ops_all_passing"] += rec["passed"] == rec["run"]
        s["ops_fully_lowered"] += rec["lowered"] == rec["run"]
        if rec["fallback_ops"]:
            ops = fell_back.setdefault(key, [])
            for a in rec["fallback_ops"]:
                if a not in ops:
                    ops.append(a)
        skip = _skip_reason(kind, key, ds)
        if rec["passed"] < rec["run"]:
            first = rec["failures"][0] if rec["failures"] else "?"
            msg = f"{rec['run'] - rec['passed']}/{rec['run']} failing; first: {first}"
            (skipped_failing if skip else failing)[f"{key}/{ds}"] = msg[:400]
        elif _listed_skip(kind, key, ds):
            stale.append(f"{key}/{ds}")
    for ops in fell_back.values():
        ops.sort()
        aten_fallbacks.update(ops)  # one count per OpInfo needing the ATen op (any dtype)
    return {
        "per_dtype": per_dtype,
        "ops_that_fell_back": dict(sorted(fell_back.items())),
        "aten_fallbacks_by_opinfo_count": dict(aten_fallbacks.most_common()),
        "failing": failing,
        "failing_but_skip_listed": skipped_failing,
        "stale_skips": stale,
    }


def _summary() -> dict:
    fwd = _kind_summary("forward")
    grad = _kind_summary("grad")
    bwd_fwd_fallbacks: Counter = Counter()
    for k, rec in RESULTS.items():
        if k[0] == "grad":
            bwd_fwd_fallbacks.update(rec.get("fwd_fallback_ops", {}).keys())
    return {
        "mode": "full" if FULL else "default",
        "torch": torch.__version__,
        "opinfos_total": len(op_db),
        "opinfos_selected": len(OPS),
        "kinds": sorted(KINDS),
        "dtypes_selected": sorted(_DTYPE_SELECT) or "all",
        "opinfos_run": _STATE["ops_run"],
        "max_samples_per_op_dtype": MAX_SAMPLES,
        "merged_details": _STATE.get("merged_details", []),
        "opinfos_with_records": {kind: len({k for (kk, k, _d), r in RESULTS.items() if kk == kind and r["run"]})
                                 for kind in ("forward", "inplace", "grad")},
        "wall_s": round(time.monotonic() - _STATE["start"], 1) if _STATE["start"] else 0.0,
        "pass_and_lowered_threshold": PASS_AND_LOWERED_THRESHOLD,
        **fwd,
        "inplace": _kind_summary("inplace"),
        "backward": {
            "note": ("grad sweep: per dtype, ops_ge98_pass_lowered counts OpInfos whose samples pass at "
                     ">= 98% with no CPU fallback during the backward pass; ops_ge98_pass ignores "
                     "fallbacks; ops_ge98_pass_fwd_bwd_lowered also requires a fallback-free forward. "
                     "aten_fallbacks_by_opinfo_count ranks the ATen ops that fell back during backward "
                     "by how many OpInfos needed them."),
            "opinfos_run": _STATE["grad_ops_run"],
            "wall_s": round(time.monotonic() - _STATE["grad_start"], 1) if _STATE["grad_start"] else 0.0,
            "max_samples_per_op_dtype": GRAD_MAX_SAMPLES,
            **grad,
            "forward_fallbacks_of_grad_samples_by_opinfo_count": dict(bwd_fwd_fallbacks.most_common()),
        },
    }


def _merge_details() -> None:
    """TORCH_TPU_OPINFO_MERGE_DETAILS=a.json,b.json: records of earlier runs (their
    TORCH_TPU_OPINFO_DETAILS files) join this session's summary, for (kind, op, dtype) entries this
    session did not run (e.g. the grad sweep and the forward sweep run as separate processes)."""
    paths = [s.strip() for s in os.environ.get("TORCH_TPU_OPINFO_MERGE_DETAILS", "").split(",") if s.strip()]
    for path in paths:
        for name, rec in json.loads(Path(path).read_text()).items():
            kind, rest = name.split(":", 1)
            key, ds = rest.rsplit("/", 1)
            RESULTS.setdefault((kind, key, ds), _rec_from_json(rec))
    if paths:
        _STATE["merged_details"] = paths


class _SummaryPlugin:
    def __init__(self) -> None:
        self.summary: dict | None = None

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        _merge_details()
        if not RESULTS:
            return
        self.summary = _summary()
        SUMMARY_PATH.parent.mkdir(parents=True, exist_ok=True)
        SUMMARY_PATH.write_text(json.dumps(self.summary, indent=1, sort_keys=False) + "\n")
        details = os.environ.get("TORCH_TPU_OPINFO_DETAILS")  # optional: every record, for debugging
        if details:
            Path(details).write_text(json.dumps({f"{k}:{key}/{d}": r for (k, key, d), r in RESULTS.items()},
                                                indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.summary is None:
            return
        s = self.summary
        tr = terminalreporter
        tr.section("OpInfo conformance summary")
        tr.write_line(json.dumps({k: s[k] for k in ("mode", "opinfos_run", "max_samples_per_op_dtype", "wall_s",
                                                     "per_dtype")}, indent=1))
        tr.write_line(f"ops that fell back ({len(s['ops_that_fell_back'])}): "
                      + json.dumps(s["ops_that_fell_back"]))
        tr.write_line(f"failing (not skip-listed): {len(s['failing'])}; skip-listed failing: "
                      f"{len(s['failing_but_skip_listed'])}; stale skips: {s['stale_skips']}")
        for kind in ("inplace", "backward"):
            k = s[kind]
            tr.write_line(f"{kind}: " + json.dumps(k["per_dtype"]))
            tr.write_line(f"{kind} failing (not skip-listed): {len(k['failing'])}; skip-listed failing: "
                          f"{len(k['failing_but_skip_listed'])}; stale skips: {k['stale_skips']}")
        top = list(s["backward"]["aten_fallbacks_by_opinfo_count"].items())[:15]
        tr.write_line(f"backward fallbacks (ATen op: OpInfos needing it): {top}")
        tr.write_line(f"written to {SUMMARY_PATH}")


@pytest.fixture(scope="module", autouse=True)
def _opinfo_session(request):
    if not request.config.pluginmanager.has_plugin("torch_tpu_opinfo_summary"):
        request.config.pluginmanager.register(_SummaryPlugin(), "torch_tpu_opinfo_summary")
    if _STATE["start"] is None:
        _STATE["start"] = time.monotonic()
    yield


def _sweep_op(kind: str, op) -> None:
    """Every dtype of one op for one test kind ("forward", which includes "inplace", or "grad")."""
    dtypes = _grad_dtypes(op) if kind == "grad" else _sweep_dtypes(op)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in dtypes:
            _sweep(op, dtype, kind)


def _rec_from_json(rec: dict) -> dict:
    return {k: (Counter(v) if k in _COUNTER_FIELDS else v) for k, v in rec.items()}


# ---------------------------------------------------------------------------------------------
# The tests
# ---------------------------------------------------------------------------------------------


def _listed_skip(kind: str, key: str, ds: str) -> bool:
    table = {"grad": GRAD_SKIPS, "inplace": INPLACE_SKIPS}.get(kind, SKIPS)
    return (key, ds) in table


def _skip_reason(kind: str, key: str, ds: str) -> str | None:
    """A kind's own skip entry, else the forward one (a forward gap is a gap of every kind)."""
    for table in ({"grad": GRAD_SKIPS, "inplace": INPLACE_SKIPS}.get(kind, {}), SKIPS):
        reason = table.get((key, ds)) or table.get((key, "*"))
        if reason:
            return reason
    return None


def _problems(key: str, kinds: tuple[str, ...]) -> tuple[int, list[str]]:
    ran, problems = 0, []
    for (k, key2, ds), rec in RESULTS.items():
        if key2 != key or k not in kinds:
            continue
        ran += rec["run"]
        if rec["passed"] < rec["run"] and not _skip_reason(k, key, ds):
            bad = "\n    ".join(rec["failures"][:4])
            problems.append(f"{k}:{key}/{ds}: {rec['run'] - rec['passed']}/{rec['run']} samples failing "
                            f"(lowered {rec['lowered']}/{rec['run']}):\n    {bad}")
    return ran, problems


def _run_test(kind: str, op) -> None:
    key = _key(op)
    if key in HARD_SKIPS:
        pytest.skip(f"hard skip: {HARD_SKIPS[key]}")
    grad = kind == "grad"
    if grad and _STATE["grad_start"] is None:
        _STATE["grad_start"] = time.monotonic()
    dtypes = _grad_dtypes(op) if grad else _sweep_dtypes(op)
    if not dtypes:
        pytest.skip("no swept dtype" + (" with autograd support" if grad else " supported on CPU"))
    _STATE["grad_ops_run" if grad else "ops_run"] += 1
    _sweep_op(kind, op)
    ran, problems = _problems(key, ("grad",) if grad else ("forward", "inplace"))
    if not ran:
        pytest.skip("the CPU reference raised for every sample (or there were none)")
    assert not problems, "\n".join(problems)


@pytest.mark.skipif("forward" not in KINDS and "inplace" not in KINDS, reason="TORCH_TPU_OPINFO_KINDS")
@pytest.mark.parametrize("op", OPS, ids=[_key(op) for op in OPS])
def test_opinfo(op):
    _run_test("forward", op)


@pytest.mark.skipif("grad" not in KINDS, reason="TORCH_TPU_OPINFO_KINDS")
@pytest.mark.parametrize("op", GRAD_OPS, ids=[_key(op) for op in GRAD_OPS])
def test_opinfo_grad(op):
    _run_test("grad", op)
