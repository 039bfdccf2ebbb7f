"""A memory plan as text (one plan, or every config side by side) and as a stacked-bar chart."""

from __future__ import annotations

from shardtune.plan.planner import GPU_FIXED_RESERVE, GPU_HEADROOM_FRACTION, GiB, MemoryPlan, gb

# The parts of per-GPU memory as the plan, the table and the chart show them: the peak phase's parts
# (phases.phase_bytes), each under one of these names, summing to the plan's total. Gathered parameters are
# buffers, as in forward/backward; the spent graph the optimizer step still holds is activations; "step" is the
# optimizer's own transient (torch AdamW's temporaries). A live DPO reference (preference.py) is a part of its own,
# REFERENCE_COMPONENT, shown where a plan holds one.
PEAK_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers", "step")
REFERENCE_COMPONENT = "reference"
PART_COMPONENT = {"weights": "weights", "gradients": "gradients", "optimizer": "optimizer",
                  "activations": "activations", "graph": "activations", "buffers": "buffers",
                  "gathered": "buffers", "persistent": "buffers", "step": "step", "reference": REFERENCE_COMPONENT}
NOT_PER_GPU = ("total", "on_host")  # a phase's sum, and the host RAM it holds
# Phase names as the plan prints them; the others with their underscores as slashes ("forward/backward").
PHASE_WORDS = {"reference_forward": "reference forward", "reference_precompute": "reference precompute"}


def components(plans: list[MemoryPlan]) -> tuple[str, ...]:
    """PEAK_COMPONENTS, and REFERENCE_COMPONENT where one of `plans` holds a live reference."""
    live = any(p.reference_mode == "live" for p in plans)
    return PEAK_COMPONENTS + ((REFERENCE_COMPONENT,) if live else ())


def peak_components(p: MemoryPlan) -> dict[str, float]:
    """The peak phase's parts per GPU under components' names: they sum to p.per_gpu["total"]."""
    parts = dict.fromkeys(components([p]), 0.0)
    for name, value in p.phases[p.peak_phase].items():
        if name not in NOT_PER_GPU:
            parts[PART_COMPONENT[name]] += value
    return parts


def checkpointing_words(on: bool, mode: str | None, interval: int = 1) -> str:
    """'off', 'on' (full, the default) or 'on (selective)', and which layers where not every one:
    'on (every 2nd layer)'."""
    if not on:
        return "off"
    details = (["selective"] if mode == "selective" else []) + \
        ([f"every {interval}{ordinal_suffix(interval)} layer"] if interval > 1 else [])
    return f"on ({', '.join(details)})" if details else "on"


def plan_checkpointing_words(p: MemoryPlan) -> str:
    return checkpointing_words(p.gradient_checkpointing, p.gradient_checkpointing_mode,
                               p.gradient_checkpointing_interval)


def ordinal_suffix(number: int) -> str:
    return "th" if 10 <= number % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(number % 10, "th")


def optimizer_words(optim: str, bf16_stochastic_round: bool) -> str:
    """The --optim name, and what --bf16_stochastic_round trades."""
    return optim + (" with bf16 stochastic rounding (no fp32 master)" if bf16_stochastic_round else "")


def phase_name(phase: str) -> str:
    return PHASE_WORDS.get(phase, phase.replace("_", "/"))


def method_line(p: MemoryPlan) -> list[str]:
    """A DPO plan's line: what a micro-batch runs and how the reference is held; none for SFT."""
    if p.method != "dpo":
        return []
    of = f" of {p.reference_model} ({p.reference_params / 1e9:,.2f}B params)" if p.reference_model else ""
    held = {"adapter": "the base with the LoRA adapter off, no second model",
            "precomputed": f"log-probs precomputed before training{of and ' by ' + of[4:]}, none held",
            "live": f"a frozen {p.mixed_precision if p.mixed_precision != 'no' else 'fp32'} copy{of}, "
                    f"{p.reference_layout}"}
    return [f"  method dpo: each pair 2 sequences ({2 * p.micro_batch} per micro-batch), reference "
            f"{p.reference_mode} ({held[p.reference_mode]})"]


HOST_EXTRAS = (("pinned_rounding", "pinned-memory rounding"),
               ("resume", "a resume's copies off its mapped optimizer shards"),
               ("export", "the final export's largest output shard"),
               ("offloaded_activations", "offloaded activations"),
               ("reference_loading", "the live reference loading"),
               ("reference_offloaded", "the live reference's offloaded partitions"))


def loss_words(p: MemoryPlan) -> str:
    if p.use_liger_kernel:
        return "Liger's fused linear cross-entropy"
    return "in tiles" if p.chunked_cross_entropy else "over the full logits"


def format_plan(p: MemoryPlan) -> str:
    rows = [f"{p.model} ({p.params:,} params) on {p.hardware} ({p.world_size} GPUs) with {p.config}, "
            f"micro-batch {p.micro_batch} x {p.max_seq_length} tokens, checkpointing "
            f"{plan_checkpointing_words(p)}, "
            f"{p.mixed_precision} ({p.activation_mode}), loss "
            f"{loss_words(p)}, optimizer "
            f"{optimizer_words(p.optim, p.bf16_stochastic_round)}"
            f"{', layers compiled (planned as eager)' if p.torch_compile else ''}"
            f"{', Liger RMSNorm, SwiGLU and RoPE' if p.use_liger_kernel else ''}",
            f"  states {p.layout}", *method_line(p)]
    rows.append(f"  per GPU at the peak, {phase_name(p.peak_phase)}:")
    rows += [f"  {name:<12}{gb(value):>12}" for name, value in peak_components(p).items()]
    rows.append(f"  {'total':<12}{gb(p.per_gpu['total']):>12}")
    rows.append("  per phase: " + ", ".join(f"{phase_name(name)} {gb(parts['total'])}"
                                             f"{' (peak)' if name == p.peak_phase else ''}"
                                             for name, parts in p.phases.items()))
    rows.append(f"  {'usable':<12}{gb(p.capacity):>12}   ({GPU_HEADROOM_FRACTION:.0%} and "
                f"{GPU_FIXED_RESERVE / GiB:.0f} GiB kept free){'' if p.gpu_fits else '   -> GPU memory binds'}")
    rows.append(f"  host RAM per node: {gb(p.host_ram_per_node)} of {gb(p.host_ram_capacity)} usable "
                f"(offloaded states {gb(p.host_ram['offloaded_states'])}, model loading "
                f"{gb(p.host_ram['model_loading'])} and the checkpoint's page cache "
                f"{gb(p.host_ram['checkpoint_page_cache'])}, which the kernel can drop"
                + (f", NVMe swap buffers {gb(p.host_ram['swap_buffers'])}" if p.host_ram["swap_buffers"] else "")
                + "".join(f", {label} {gb(p.host_ram[key])}" for key, label in HOST_EXTRAS if p.host_ram.get(key))
                + (f", checkpoint staging {gb(p.host_ram['checkpoint_staging'])}"
                   if p.host_ram["checkpoint_staging"] else "") + ")"
                + ("" if p.host_ram_fits else "   -> host RAM binds"))
    rows.append(f"  -> {'fits' if p.fits else 'DOES NOT FIT'}")
    if p.nvme_per_node:
        rows.append(f"  NVMe per node: {gb(p.nvme_per_node)}")
    return "\n".join(rows + [f"  note: {note}" for note in p.notes])


def format_compare(plans: list[MemoryPlan]) -> str:
    """One row per config: the peak phase's parts per GPU (they sum to the total), its name, and host RAM."""
    header = (f"{'config':<30}" + "".join(f"{c:>12}" for c in (*components(plans), "total")) + f"  {'peak':<18}"
              + f"{'host/node':>10}  fits")
    lines = [header]
    for p in plans:
        parts = {**dict.fromkeys(components(plans), 0.0), **peak_components(p)}
        cells = "".join(f"{value / 1e9:>11.1f}G" for value in (*parts.values(), p.per_gpu["total"]))
        lines.append(f"{p.config:<30}{cells}  {phase_name(p.peak_phase):<18}{p.host_ram_per_node / 1e9:>9.1f}G"
                     f"  {'yes' if p.fits else 'no'}")
    lines.append(f"usable per GPU: {gb(plans[0].capacity)}. Each row is its config's peak phase, whose parts sum to "
                 "the total (step: the optimizer step's own transient).")
    return "\n".join(lines)


def chart_bars(plans: list[MemoryPlan]) -> dict[str, list[float]]:
    """The chart's stacked bars in GB: per component, one height per plan (peak_components, the table's)."""
    return {component: [peak_components(p).get(component, 0.0) / 1e9 for p in plans]
            for component in components(plans)}


def write_chart(plans: list[MemoryPlan], path: str) -> dict[str, float]:
    """Stacked bars of each config's peak phase, in the table's components, with the usable capacity as a line.
    Returns the height of each config's drawn bar in GB, read back from the chart."""
    import matplotlib  # here only: the planner itself stays light

    matplotlib.use("Agg")  # no display on training nodes or CI
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6, 1.2 * len(plans)), 5))
    names = [p.config for p in plans]
    bottom = [0.0] * len(plans)
    for component, values in chart_bars(plans).items():
        axes.bar(names, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.axhline(plans[0].capacity / 1e9, color="black", linestyle="--", label="usable capacity")
    axes.set_ylabel("GB per GPU at the peak phase")
    axes.set_title(f"{plans[0].model} on {plans[0].hardware}")
    axes.tick_params(axis="x", labelrotation=45)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    heights = dict.fromkeys(names, 0.0)
    for container in axes.containers:
        for name, bar in zip(names, container, strict=True):
            heights[name] += bar.get_height()
    plt.close(figure)
    return heights
