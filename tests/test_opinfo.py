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

Modes:
  default (`make test`): at most 3 samples per (op, dtype); dtypes float32, bfloat16, int64
      (or the first other swept dtype when the op supports none of those); a global time budget
      (TORCH_TPU_OPINFO_BUDGET seconds, default 390) after which the remaining ops are skipped.
  full (`TORCH_TPU_CONFORMANCE=full`, `make conformance`): every sample of every dtype in
      (float32, bfloat16, float16, float64, int32, int64, bool), no budget.
TORCH_TPU_OPINFO_OPS=name1,name2 restricts the sweep to those OpInfo keys (debugging).

At the end of the session a summary is written to benchmarks/results/opinfo_summary.json and
printed in pytest's terminal summary.
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
from opinfo_skips import HARD_SKIPS, SKIPS  # noqa: E402

DEV = "tpu"
FULL = os.environ.get("TORCH_TPU_CONFORMANCE", "").strip().lower() == "full"
ALL_DTYPES = (
    torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int32, torch.int64, torch.bool,
)
DEFAULT_DTYPES = (torch.float32, torch.bfloat16, torch.int64)
MAX_SAMPLES = None if FULL else 3
BUDGET_S = float(os.environ.get("TORCH_TPU_OPINFO_BUDGET", "0" if FULL else "390"))  # 0: none
# Default mode: stop taking new samples of one op after this long (each dtype keeps >= 1 sample).
PER_OP_S = 0.0 if FULL else float(os.environ.get("TORCH_TPU_OPINFO_PER_OP_S", "6"))
SUMMARY_PATH = Path(__file__).resolve().parent.parent / "benchmarks" / "results" / "opinfo_summary.json"
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
        return [d for d in ALL_DTYPES if d in supported]
    picked = [d for d in DEFAULT_DTYPES if d in supported]
    if not picked:  # bool-only (or f64/f16/i32-only) ops: take the first one we sweep
        picked = [d for d in (torch.bool, *ALL_DTYPES) if d in supported][:1]
    return picked


_SELECT = {s.strip() for s in os.environ.get("TORCH_TPU_OPINFO_OPS", "").split(",") if s.strip()}
OPS = [op for op in op_db if not _SELECT or _key(op) in _SELECT]

# ---------------------------------------------------------------------------------------------
# Recording
# ---------------------------------------------------------------------------------------------

RESULTS: dict[tuple[str, str], dict] = {}
_STATE = {"start": None, "ops_run": 0, "ops_budget_skipped": 0, "map_guard_stop": None,
          "ops_map_guard_skipped": 0}

# Every XLA CPU executable holds ~30 memory mappings and the runtime never frees executables, so
# a process that compiles ~1,900 distinct programs reaches vm.max_map_count (65,530): XLA then
# fails with "Failed to materialize symbols" and the process segfaults while that error is
# thrown. Stop sweeping before that (remaining ops are skipped and listed in the summary; run
# them in a new process with TORCH_TPU_OPINFO_OPS).
try:
    _MAX_MAPS = int(Path("/proc/sys/vm/max_map_count").read_text())
except (OSError, ValueError):
    _MAX_MAPS = 0
MAP_GUARD_FRACTION = 0.85
_MAP_CHECK_EVERY = 8  # samples


def _map_count() -> int:
    try:
        with open("/proc/self/maps", "rb") as f:
            return f.read().count(b"\n")
    except OSError:
        return 0


def _near_map_limit() -> bool:
    return bool(_MAX_MAPS) and _map_count() > MAP_GUARD_FRACTION * _MAX_MAPS


def _record(key: str, dtype: torch.dtype) -> dict:
    return RESULTS.setdefault(
        (key, _dstr(dtype)),
        {
            "run": 0,  # samples whose CPU reference ran
            "passed": 0,
            "lowered": 0,  # samples with no CPU fallback
            "passed_lowered": 0,
            "cpu_ref_errors": 0,
            "fallback_ops": Counter(),
            "failures": [],
            "passed_by_tie_or_f64_ref": 0,  # passed only via _ties_ok / _matches_higher_precision
            "sample_gen_error": None,
        },
    )


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
        with torch.no_grad():
            t = _view_to_tpu(x, memo)
            if t is None:
                t = x.detach().to(DEV)
        if x.requires_grad and t.is_floating_point():
            t.requires_grad_(True)
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
    # Pristine float64 copy for the higher-precision check (the CPU run may mutate `sample`).
    hp = (_upcast(sample.input), _upcast(sample.args), _upcast(sample.kwargs)) \
        if dtype in HP_DTYPES and not random else None
    pristine_input = _upcast(sample.input) if key in TIE_INDEX_OPS else None
    try:
        expected = op(sample.input, *sample.args, **sample.kwargs)
    except Exception:
        rec["cpu_ref_errors"] += 1
        return
    rec["run"] += 1
    torch_tpu.reset_fallback_stats()
    error = None
    try:
        actual = op(tpu_input, *tpu_args, **tpu_kwargs)
        torch_tpu.synchronize()
    except Exception as err:  # a lowering must fall back, never raise
        error = err
    fallbacks = torch_tpu.fallback_stats()
    torch_tpu.reset_fallback_stats()
    lowered = not fallbacks
    rec["fallback_ops"].update(fallbacks)
    rec["lowered"] += lowered
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


# Ops that return indices of equal values in an order PyTorch leaves unspecified
# (sort/argsort with stable=False, topk): index ties are accepted when the indices are a valid
# choice, i.e. distinct and gathering the input at them gives the CPU's values.
TIE_INDEX_OPS = {"sort": 0, "argsort": 0, "topk": 1}  # positional index of `dim` in sample.args


def _ties_ok(key, sample, x, actual, expected, dtype) -> bool:
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


def _sweep(op, dtype: torch.dtype, op_deadline: float | None) -> dict:
    key = _key(op)
    rec = _record(key, dtype)
    random = _is_random(op)
    torch.manual_seed(zlib.crc32(f"{key}/{dtype}".encode()))
    taken = 0
    try:
        samples = iter(op.sample_inputs("cpu", dtype))
    except Exception as err:
        rec["sample_gen_error"] = _short(err, 200)
        return rec
    while MAX_SAMPLES is None or taken < MAX_SAMPLES:
        if taken and op_deadline is not None and time.monotonic() > op_deadline:
            break
        try:
            sample = next(samples)
        except StopIteration:
            break
        except Exception as err:  # sample generation itself failed: nothing to compare
            rec["sample_gen_error"] = _short(err, 200)
            break
        taken += 1
        if taken % _MAP_CHECK_EVERY == 0 and _near_map_limit():
            _STATE["map_guard_stop"] = f"{key}/{_dstr(dtype)} after {taken - 1} samples"
            rec["truncated_by_map_guard"] = True
            break
        _run_sample(op, sample, rec, random, dtype)
    return rec


# ---------------------------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------------------------


def _summary() -> dict:
    per_dtype: dict[str, dict] = {}
    fell_back: dict[str, list[str]] = {}
    aten_fallbacks: Counter = Counter()
    failing: dict[str, str] = {}
    skipped_failing: dict[str, str] = {}
    stale: list[str] = []
    for (key, ds), rec in sorted(RESULTS.items()):
        if rec["run"] == 0:
            continue
        s = per_dtype.setdefault(ds, {"ops_swept": 0, "ops_ge98_pass_lowered": 0, "ops_all_passing": 0,
                                      "ops_fully_lowered": 0, "samples": 0, "samples_passed": 0,
                                      "samples_lowered": 0, "samples_passed_lowered": 0,
                                      "samples_passed_via_tie_or_f64_ref": 0})
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
            for a in rec["fallback_ops"]:
                aten_fallbacks[a] += 1
        skip = _skip_reason(key, ds)
        if rec["passed"] < rec["run"]:
            first = rec["failures"][0] if rec["failures"] else "?"
            msg = f"{rec['run'] - rec['passed']}/{rec['run']} failing; first: {first}"
            (skipped_failing if skip else failing)[f"{key}/{ds}"] = msg[:400]
        elif skip and (key, ds) in SKIPS:
            stale.append(f"{key}/{ds}")
    for ops in fell_back.values():
        ops.sort()
    return {
        "mode": "full" if FULL else "default",
        "torch": torch.__version__,
        "opinfos_total": len(op_db),
        "opinfos_selected": len(OPS),
        "opinfos_run": _STATE["ops_run"],
        "opinfos_skipped_for_budget": _STATE["ops_budget_skipped"],
        "map_guard_stop": _STATE["map_guard_stop"],
        "opinfos_skipped_for_map_guard": _STATE.get("map_guard_skipped_ops", []),
        "truncated_by_map_guard": sorted(f"{k}/{d}" for (k, d), r in RESULTS.items()
                                         if r.get("truncated_by_map_guard")),
        "wall_s": round(time.monotonic() - _STATE["start"], 1) if _STATE["start"] else 0.0,
        "pass_and_lowered_threshold": PASS_AND_LOWERED_THRESHOLD,
        "per_dtype": per_dtype,
        "ops_that_fell_back": dict(sorted(fell_back.items())),
        "aten_fallbacks_by_opinfo_count": dict(aten_fallbacks.most_common()),
        "failing": failing,
        "failing_but_skip_listed": skipped_failing,
        "stale_skips": stale,
    }


class _SummaryPlugin:
    def __init__(self) -> None:
        self.summary: dict | None = None

    def pytest_sessionfinish(self, session, exitstatus) -> None:
        if not RESULTS:
            return
        self.summary = _summary()
        SUMMARY_PATH.parent.mkdir(parents=True, exist_ok=True)
        SUMMARY_PATH.write_text(json.dumps(self.summary, indent=1, sort_keys=False) + "\n")
        details = os.environ.get("TORCH_TPU_OPINFO_DETAILS")  # optional: every record, for debugging
        if details:
            Path(details).write_text(json.dumps({f"{k}/{d}": r for (k, d), r in RESULTS.items()}, indent=1))

    def pytest_terminal_summary(self, terminalreporter) -> None:
        if self.summary is None:
            return
        s = self.summary
        tr = terminalreporter
        tr.section("OpInfo conformance summary")
        tr.write_line(json.dumps({k: s[k] for k in ("mode", "opinfos_run", "opinfos_skipped_for_budget",
                                                     "map_guard_stop", "wall_s", "per_dtype")}, indent=1))
        tr.write_line(f"ops that fell back ({len(s['ops_that_fell_back'])}): "
                      + json.dumps(s["ops_that_fell_back"]))
        tr.write_line(f"failing (not skip-listed): {len(s['failing'])}; skip-listed failing: "
                      f"{len(s['failing_but_skip_listed'])}; stale skips: {s['stale_skips']}")
        tr.write_line(f"written to {SUMMARY_PATH}")


@pytest.fixture(scope="module", autouse=True)
def _opinfo_session(request):
    if not request.config.pluginmanager.has_plugin("torch_tpu_opinfo_summary"):
        request.config.pluginmanager.register(_SummaryPlugin(), "torch_tpu_opinfo_summary")
    if _STATE["start"] is None:
        _STATE["start"] = time.monotonic()
    yield


# ---------------------------------------------------------------------------------------------
# The test
# ---------------------------------------------------------------------------------------------


def _skip_reason(key: str, ds: str) -> str | None:
    return SKIPS.get((key, ds)) or SKIPS.get((key, "*"))


@pytest.mark.parametrize("op", OPS, ids=[_key(op) for op in OPS])
def test_opinfo(op):
    key = _key(op)
    if key in HARD_SKIPS:
        pytest.skip(f"hard skip: {HARD_SKIPS[key]}")
    now = time.monotonic()
    if BUDGET_S and now - _STATE["start"] > BUDGET_S:
        _STATE["ops_budget_skipped"] += 1
        pytest.skip(f"default-mode budget of {BUDGET_S:.0f}s spent (TORCH_TPU_CONFORMANCE=full runs all)")
    if _STATE["map_guard_stop"] or _near_map_limit():
        _STATE["map_guard_stop"] = _STATE["map_guard_stop"] or f"before {key}"
        _STATE["ops_map_guard_skipped"] += 1
        _STATE.setdefault("map_guard_skipped_ops", []).append(key)
        pytest.skip(f"process near vm.max_map_count ({_STATE['map_guard_stop']}): run the remaining ops "
                    "in a new process (TORCH_TPU_OPINFO_OPS=...)")
    dtypes = _sweep_dtypes(op)
    if not dtypes:
        pytest.skip("supports none of the swept dtypes on CPU")
    _STATE["ops_run"] += 1
    op_deadline = now + PER_OP_S if PER_OP_S else None
    problems = []
    ran = 0
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        for dtype in dtypes:
            if _STATE["map_guard_stop"]:
                break
            rec = _sweep(op, dtype, op_deadline)
            ran += rec["run"]
            ds = _dstr(dtype)
            if rec["passed"] < rec["run"] and not _skip_reason(key, ds):
                bad = "\n    ".join(rec["failures"][:4])
                problems.append(f"{key}/{ds}: {rec['run'] - rec['passed']}/{rec['run']} samples failing "
                                f"(lowered {rec['lowered']}/{rec['run']}):\n    {bad}")
    if not ran:
        pytest.skip("the CPU reference raised for every sample (or there were none)")
    assert not problems, "\n".join(problems)
