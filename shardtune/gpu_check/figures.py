"""gpu_check's figures, apart from its runner (scripts/gpu_check.py) so that both stay readable and the arithmetic is
tested on CPU: a case's figures from its metrics.jsonl, the planner's reserves against what was reserved, the
modules Liger and fp8 replaced against the planned number, the comparison of a Liger, fp8 or levers case with its
plain case, and the closing table. A NaN fails every check it reaches."""

from __future__ import annotations

import contextlib
import io
import json
import math
import os
import statistics
import tarfile
from pathlib import Path

# The first steps, logged apart as the warm-up (CUDA start-up, compilation, autotuning): rates and training peaks are
# the later steps' (the timed windows).
WARMUP_STEPS = 2
TOLERANCE = 0.10  # a planned peak against the measured one, relative
# A compared case against its plain case (the same name without the suffix), relative. Liger: bf16 kernels that
# round differently (fused norm, SwiGLU, RoPE and loss), about 1e-2. fp8: e4m3 keeps 3 mantissa bits, so each matmul's
# output moves by about 3.5% (rms) and the final hidden states by several percent; the gradient norm and the loss,
# sums over millions of terms, average that out. A decoder scaled by 50 or replaced by noise moves the hidden
# states by far more than either (tests/unit/gpu_check/test_gpu_check_compare.py). The levers (compile, 8-bit
# AdamW, bf16 stochastic rounding) change the numerics of the forward (compile's fused kernels) and of each update
# (8-bit moments, rounding): losses and gradient norms only, as their model's hidden states move by updates of lr
# 1e-5.
# "grad_norm": every logged step's, the largest gap counted.
COMPARED = {" liger": {"grad_norm": 0.01, "hidden": 0.01, "loss": 0.01},
            " fp8": {"grad_norm": 0.02, "hidden": 0.10, "loss": 0.02},
            " levers": {"grad_norm": 0.03, "loss": 0.02}}
# What Liger and fp8 replace in a Llama decoder of L layers (levers.liger, levers.float8): Liger's RMSNorm in
# each layer's two norms and the final one, its SwiGLU in each MLP, its RoPE in the modeling module; torchao's
# Float8Linear for each layer's seven projections (never lm_head).
LLAMA_PROJECTIONS = 7
MEASURED_PHASES = (("train", "peak_memory_gb"), ("save", "save_peak_memory_gb"), ("eval", "eval_peak_memory_gb"))


def summarize(rows: list[dict], planned: dict[str, float], gpu_memory_gb: float | None = None) -> dict:
    """A case's figures from its metrics.jsonl rows: the first WARMUP_STEPS steps apart (warm-up), the later ones
    timed; the training peaks over the timed steps only. `gpu_memory_gb`: the device's, for the planner's reserve
    assumptions (shardtune.plan.planner: fragmentation within GPU_HEADROOM_FRACTION of it, the CUDA context and
    what else sits outside the allocator within GPU_FIXED_RESERVE)."""
    windows = [row for row in rows if "loss" in row]
    warmup = [row for row in windows if row["step"] <= WARMUP_STEPS]
    timed = [row for row in windows if row["step"] > WARMUP_STEPS]
    if not warmup or not timed:
        return {"error": "metrics.jsonl holds no warm-up or no timed window"}
    steps = [row["step"] for row in windows]
    result = {"losses": [row["loss"] for row in windows],
              "grad_norms": [row.get("grad_norm", math.nan) for row in windows],
              "first_grad_norm": windows[0].get("grad_norm", math.nan) if steps[0] == 1 else math.nan,
              "warmup_s": sum(row["step_time_s"] * (row["step"] - before) for row, before in
                              zip(warmup, [0, *steps], strict=False)),
              "tokens_per_second_per_gpu": statistics.mean(row["tokens_per_second_per_device"] for row in timed),
              "mfu": statistics.mean(row.get("mfu", math.nan) for row in timed),
              "step_time_s": statistics.median(row["step_time_s"] for row in timed)}
    for phase, key in MEASURED_PHASES:
        values = [row[key] for row in (timed if phase == "train" else rows) if key in row]
        if not values:
            return {**result, "error": f"metrics.jsonl has no {key}"}
        measured = max(values)  # GB, as metrics.jsonl logs them and the planner counts
        result[f"{phase}_gb"], result[f"{phase}_planned_gb"] = measured, planned[phase]
        result[f"{phase}_error"] = planned[phase] / measured - 1
    for key in ("peak_reserved_gb", "device_used_gb"):
        result[f"train_{key.removeprefix('peak_').removesuffix('_gb')}_gb"] = max(
            (row[key] for row in timed if key in row), default=math.nan)
    result.update(reserve_against_plan(result["train_gb"], result["train_reserved_gb"], result["train_device_used_gb"],
                                       gpu_memory_gb))
    return result


def reserve_against_plan(allocated: float, reserved: float, used: float, gpu_memory_gb: float | None) -> dict:
    """The planner's two reserves against the timed windows: fragmentation (reserved - allocated peak) against
    GPU_HEADROOM_FRACTION of the GPU, and memory outside the caching allocator (device in use - reserved: the CUDA
    context, cuBLAS and NCCL workspaces) against GPU_FIXED_RESERVE; GB. NaN where not measured."""
    from shardtune.plan.planner import GPU_FIXED_RESERVE, GPU_HEADROOM_FRACTION

    headroom = GPU_HEADROOM_FRACTION * gpu_memory_gb if gpu_memory_gb else math.nan
    return {"fragmentation_gb": reserved - allocated, "fragmentation_planned_gb": headroom,
            "outside_allocator_gb": used - reserved, "outside_allocator_planned_gb": GPU_FIXED_RESERVE / 1e9}


def reserve_misses(row: dict) -> list[str]:
    """The reserves exceeded, or not measured (NaN)."""
    return [name for name in ("fragmentation", "outside_allocator")
            if not row.get(f"{name}_gb", math.nan) <= row.get(f"{name}_planned_gb", math.nan)]


def planned_replacements(suffix: str, layers: int) -> dict[str, int]:
    """What a compared case's feature replaces in a Llama decoder of `layers` layers (none for the levers)."""
    if suffix == " liger":
        return {"liger_rms_norm": 2 * layers + 1, "liger_swiglu": layers, "liger_rope": 1}
    if suffix == " fp8":
        return {"float8_linears": LLAMA_PROJECTIONS * layers}
    return {}


def replaced_modules(model) -> dict[str, int]:
    """What Liger and fp8 replaced in `model`: the modules running Liger's RMSNorm or SwiGLU forward (Liger binds
    its forwards to the instances), whether the model's modeling module calls Liger's RoPE, torchao's
    Float8Linear modules. A feature whose package is not importable counts 0."""
    import sys

    counts = {"liger_rms_norm": 0, "liger_swiglu": 0, "liger_rope": 0, "float8_linears": 0}
    modules = list(model.modules())
    try:
        from liger_kernel.transformers.rms_norm import LigerRMSNorm
        from liger_kernel.transformers.rope import liger_rotary_pos_emb
        from liger_kernel.transformers.swiglu import LigerSwiGLUMLP
    except ImportError:
        pass
    else:
        def runs(module, forward) -> bool:
            return getattr(module.__dict__.get("forward"), "__func__", None) is forward

        counts["liger_rms_norm"] = sum(runs(module, LigerRMSNorm.forward) for module in modules)
        counts["liger_swiglu"] = sum(runs(module, LigerSwiGLUMLP.forward) for module in modules)
        modeling = sys.modules.get(type(model).__module__)
        counts["liger_rope"] = int(getattr(modeling, "apply_rotary_pos_emb", None) is liger_rotary_pos_emb)
    try:
        from torchao.float8.float8_linear import Float8Linear
    except ImportError:
        pass
    else:
        counts["float8_linears"] = sum(isinstance(module, Float8Linear) for module in modules)
    return counts


def replacement_misses(row: dict) -> list[str]:
    """The replaced-module counts of a trained compared case that differ from the planned ones (or were not
    recorded): a feature that did nothing, or did it to the wrong modules."""
    planned = row.get("replaced_planned") or {}
    if not planned and compared_suffix(row["case"]) in (" liger", " fp8"):
        return ["no planned count"]
    recorded = row.get("replaced") or {}
    return [name for name, count in planned.items() if recorded.get(name) != count]


def case_name(config: str, accumulation: int, packing: bool, levers: dict) -> str:
    suffix = " liger" if levers.get("use_liger_kernel") else " fp8" if levers.get("mixed_precision") == "fp8" \
        else " levers" if levers else ""
    return f"{config} {'packed' if packing else 'padded'} x{accumulation}{suffix}"


def compared_suffix(case: str) -> str:
    """The suffix of a case compared with its plain case (a COMPARED key), else ''."""
    return next((suffix for suffix in COMPARED if case.endswith(suffix)), "")


def largest_gap(mine: list, theirs: list) -> float:
    """The largest relative gap of two series step by step; NaN where their lengths differ or any value is NaN or
    missing (None)."""
    if len(mine) != len(theirs):
        return math.nan
    gaps = [abs(a / b - 1) if a is not None and b is not None and b != 0 else math.nan for a, b in
            zip(mine, theirs, strict=True)]
    return math.nan if any(not math.isfinite(gap) for gap in gaps) else max(gaps)


def relative_gaps(mine: dict, theirs: dict) -> dict[str, float]:
    """A compared case's figures against its plain case's, each relative to the plain one, for the figures both
    have: "grad_norm" ("grad_norms": every logged step's, or "grad_norm": one), "hidden" (tensors: the final hidden
    states of the fixed batch; the norm of the difference over the plain one's) and "losses" (the largest gap of the
    logged losses). Where the series differ in length or hold a NaN, the gap is NaN."""
    gaps = {}
    norms = [figures.get("grad_norms") or ([figures["grad_norm"]] if figures.get("grad_norm") is not None else None)
             for figures in (mine, theirs)]
    if norms[0] and norms[1]:
        gaps["grad_norm"] = largest_gap(*norms)
    if mine.get("hidden") is not None and theirs.get("hidden") is not None:
        difference = (mine["hidden"].float() - theirs["hidden"].float()).norm()
        gaps["hidden"] = float(difference / theirs["hidden"].float().norm())
    if mine.get("losses") and theirs.get("losses"):
        gaps["loss"] = largest_gap(mine["losses"], theirs["losses"])
    return gaps


def over_tolerance(gaps: dict[str, float], tolerance: dict[str, float]) -> list[str]:
    """The figures of `tolerance` whose gap is over it, NaN or missing (a comparison that did not happen fails)."""
    return [name for name, limit in tolerance.items() if not gaps.get(name, math.nan) <= limit]


def comparison(row: dict, plain: dict) -> dict:
    """A compared case's trained row against its plain case's (rows as gpu_check writes them; "hidden_file": the
    saved final hidden states, read on the host)."""
    suffix = compared_suffix(row["case"])
    figures = []
    for each in (row, plain):
        figures.append({"grad_norms": each.get("grad_norms"), "grad_norm": each.get("first_grad_norm"),
                        "losses": each.get("losses")})
        if each.get("hidden_file") and Path(each["hidden_file"]).is_file():
            import torch

            figures[-1]["hidden"] = torch.load(each["hidden_file"], map_location="cpu")
    gaps = relative_gaps(*figures)
    return {"comparison": row["case"], "plain": plain["case"], "tolerance": COMPARED[suffix], "gaps": gaps,
            "failed": over_tolerance(gaps, COMPARED[suffix])}


def final_hidden_states(model_dir: str, suffix: str, ids):
    """The final hidden states (after the last norm) of the fixed batch `ids` through the exported model at
    `model_dir`, on the GPU in bf16, with the compared case's kernels: Liger's norm, SwiGLU and RoPE, or float8
    linears; float32 on the host."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.bfloat16, attn_implementation="sdpa")
    if suffix == " liger":
        from shardtune.levers.liger import apply_liger_kernels

        apply_liger_kernels(model)
    elif suffix == " fp8":
        from shardtune.levers.float8 import convert_linears

        convert_linears(model, all_gather=False)
    return last_hidden_states(model.cuda(), ids)


def last_hidden_states(model, ids):
    """The decoder's output after its final norm (what the LM head reads) for token ids `ids`, float32 on the host."""
    import torch

    with torch.no_grad():
        return model.model(input_ids=ids.to(model.device)).last_hidden_state.float().cpu()


# --- records: --out's JSON lines ---------------------------------------------------------------------------


def as_json(value):
    """`value` with NaN and infinities as null: each line of --out stays JSON."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: as_json(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [as_json(item) for item in value]
    return value


def append_jsonl(path: str | None, record: dict) -> None:
    if path:
        with open(path, "a") as file:
            file.write(json.dumps(as_json(record)) + "\n")
            file.flush()
            os.fsync(file.fileno())


def earlier_records(path: str | None) -> list[dict]:
    """The rows and comparisons an earlier command appended to --out (none without one)."""
    if not path or not Path(path).is_file():
        return []
    return [json.loads(line) for line in Path(path).read_text().splitlines() if line.strip()]


def not_run(cases: list, records: list[dict]) -> list:
    """--rest: the cases without a row in `records`, or whose row says the budget did not let them start."""
    ran = {record["case"] for record in records if "case" in record and
           not str(record.get("error", "")).startswith("not started")}
    return [case for case in cases if case_name(*case) not in ran]


def new_comparisons(rows: dict[str, dict], done: set[str]) -> list[dict]:
    """The comparisons `rows` (the latest row of each case, trained or not) allow that are not in `done`."""
    found = []
    for name, row in rows.items():
        plain = rows.get(name.removesuffix(compared_suffix(name)))
        if compared_suffix(name) and name not in done and plain and "error" not in row and "error" not in plain:
            found.append(comparison(row, plain))
    return found


class Reporter:
    """The three files that come back from the device: --out (a JSON line per row and comparison, appended as each
    ends), --table (the table as printed) and --archive (a tar.gz of --log_dir's logs), the last two rewritten
    whole, each through a temporary file, so that a kill at any moment leaves the previous complete one."""

    def __init__(self, args) -> None:
        self.out, self.table, self.archive, self.log_dir = args.out, args.table, args.archive, Path(args.log_dir)

    def append(self, record: dict) -> None:
        append_jsonl(self.out, record)

    def write(self, rows: list[dict], comparisons: list[dict]) -> None:
        if self.table:
            text = io.StringIO()
            with contextlib.redirect_stdout(text):
                print_table(rows, comparisons)
            replace_file(Path(self.table), text.getvalue().encode())
        if self.archive:
            packed = io.BytesIO()
            with tarfile.open(fileobj=packed, mode="w:gz") as archive:
                for path in sorted(self.log_dir.glob("*")):
                    if path.suffix in (".log", ".jsonl", ".json"):
                        archive.add(path, arcname=f"gpu-check/{path.name}")
            replace_file(Path(self.archive), packed.getvalue())


def replace_file(path: Path, content: bytes) -> None:
    partial = path.with_name(path.name + ".partial")
    partial.write_bytes(content)
    os.replace(partial, path)


# --- the table -------------------------------------------------------------------------------------------------


def print_table(rows: list[dict], comparisons: list[dict] = ()) -> None:
    phases = "".join(f"{phase + ' GB':>10}{'plan':>7}" for phase, _ in MEASURED_PHASES)
    print(f"{'case':<34}{'warm-up s':>10}{'tok/s/GPU':>11}{'MFU':>7}{'step s':>8}{phases}{'worst':>8}"
          f"{'reserved':>10}{'used':>7}")
    for row in rows:
        if "error" in row:
            print(f"{row['case']:<34} FAILED: {row['error']}")
            continue
        figures = "".join(f"{row[f'{phase}_gb']:>10.1f}{row[f'{phase}_planned_gb']:>7.1f}" for phase, _ in
                          MEASURED_PHASES)
        print(f"{row['case']:<34}{row['warmup_s']:>10.1f}{row['tokens_per_second_per_gpu']:>11,.0f}"
              f"{row['mfu']:>7.1%}{row['step_time_s']:>8.2f}{figures}{worst_error(row):>+8.1%}"
              f"{row.get('train_reserved_gb', math.nan):>10.1f}{row.get('train_device_used_gb', math.nan):>7.1f}")
    for row in rows:
        if "error" not in row and "fragmentation_gb" in row:
            print(f"{row['case']}: reserved - allocated {row['fragmentation_gb']:.2f} GB (planned headroom "
                  f"{row['fragmentation_planned_gb']:.2f}), outside the allocator {row['outside_allocator_gb']:.2f} "
                  f"GB (planned {row['outside_allocator_planned_gb']:.2f})")
    for row in rows:
        if "error" not in row and row.get("replaced_planned"):
            counts = ", ".join(f"{name} {(row.get('replaced') or {}).get(name)} (planned {count})"
                               for name, count in row["replaced_planned"].items())
            verdict = "FAILED" if replacement_misses(row) else "ok"
            print(f"{row['case']}: replaced {counts}: {verdict}")
    for comparison in comparisons:
        gaps = ", ".join(f"{name} {comparison['gaps'].get(name, math.nan):.2%} (tolerance {limit:.0%})"
                         for name, limit in comparison["tolerance"].items())
        verdict = f"FAILED: {', '.join(comparison['failed'])}" if comparison["failed"] else "ok"
        note = f"; {comparison['error']}" if "error" in comparison else ""
        print(f"{comparison['comparison']} against {comparison['plain']}: {gaps}: {verdict}{note}")


def worst_error(row: dict) -> float:
    """The planned peak's largest miss, NaN where any phase's is NaN or missing."""
    errors = [row.get(f"{phase}_error", math.nan) for phase, _ in MEASURED_PHASES]
    return math.nan if any(not math.isfinite(error) for error in errors) else max(errors, key=abs)


def non_finite(row: dict) -> bool:
    """Whether a trained case logged a NaN or infinite loss or gradient norm."""
    return any(value is None or not math.isfinite(value) for value in [*row.get("losses", []),
                                                                      *row.get("grad_norms", [])])


def failed_cases(rows: list[dict], comparisons: list[dict] = ()) -> list[str]:
    """Cases that failed, missed a planned peak by more than TOLERANCE or a planned reserve, logged a NaN, or
    (compared cases) replaced other than the planned number of modules or whose comparison failed or did not
    happen."""
    compared = {comparison["comparison"]: comparison for comparison in comparisons}
    failed = []
    for row in rows:
        name = row["case"]
        if "error" in row or not abs(worst_error(row)) <= TOLERANCE or reserve_misses(row) or non_finite(row) or \
                replacement_misses(row) or \
                (compared_suffix(name) and compared.get(name, {"failed": ["missing"]})["failed"]):
            failed.append(name)
    return failed


