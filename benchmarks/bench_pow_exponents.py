"""pow(Tensor, Scalar) in strict eager at the exponents ATen's CPU kernel special-cases (0.5 sqrt,
-0.5 rsqrt, -1, -2, 2, 3): program constants, lowered to ATen's forms. Baselines measured in this
run, interleaved: the same op with a nearby generic exponent (e + 1e-6: a runtime operand and
XLA:CPU's per-element pow, what every exponent outside -1..3 cost before) and PyTorch CPU.
f32 [128, 768] (a BERT-base hidden state). Goal: special exponent <= 0.5x the generic one."""

from __future__ import annotations

from typing import Any

import bench_common  # noqa: F401  (sets HF_HUB_OFFLINE before transformers loads)
import torch
from bench_common import TPU, finish, interleaved, median, ratio, sync

NAME = "pow_exponents"
EXPONENTS = [0.5, -0.5, -1.0, -2.0, 2.0, 3.0]
LAUNCHES = 50


def main() -> dict[str, Any]:
    x = torch.rand(128, 768) + 0.1
    xd = x.to(TPU)

    def tpu(e: float) -> Any:
        def fn() -> None:
            for _ in range(LAUNCHES):
                torch.pow(xd, e)
            sync()

        return fn

    def cpu(e: float) -> Any:
        def fn() -> None:
            for _ in range(LAUNCHES):
                torch.pow(x, e)

        return fn

    rows: dict[str, Any] = {}
    ratios = []
    for e in EXPONENTS:
        fns = {"special": tpu(e), "generic": tpu(e + 1e-6), "cpu": cpu(e)}
        for fn in fns.values():
            fn()  # compile / warm up
        t = {k: median(v) / LAUNCHES * 1e3 for k, v in interleaved(fns, repeats=7).items()}
        rows[str(e)] = {f"{k}_ms": round(v, 4) for k, v in t.items()}
        ratios.append(
            ratio(f"pow {e:g} / generic pow", t["special"] / t["generic"], 0.5, higher_is_better=False)
        )
        rows[str(e)]["special_over_cpu"] = round(t["special"] / t["cpu"], 2)
    summary = "; ".join(
        f"{e}: {r['special_ms']:.3f} ms vs generic {r['generic_ms']:.3f}, cpu {r['cpu_ms']:.3f}"
        for e, r in rows.items()
    )
    return finish(NAME, {"rows": rows, "ratios": ratios, "summary": f"{NAME} (ms/op) {summary}"})


if __name__ == "__main__":
    main()
