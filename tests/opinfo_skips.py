"""Reviewed known gaps for tests/test_opinfo.py.

SKIPS maps (opinfo_key, dtype_str or "*") -> reason. opinfo_key is the OpInfo name, plus
"." + variant_test_name when the OpInfo has a variant (e.g. "max.reduction_with_dim"); dtype_str
is e.g. "float32", "bfloat16", "int64". A listed (op, dtype) is still run and reported in the
summary JSON, but its mismatches do not fail the test. Entries that start passing show up as
"stale_skips" in the summary: delete them then.

HARD_SKIPS: OpInfo keys that are not run at all (they crash or hang the process). Keep empty
unless a real crash was observed.
"""

SKIPS: dict[tuple[str, str], str] = {}

HARD_SKIPS: dict[str, str] = {}
