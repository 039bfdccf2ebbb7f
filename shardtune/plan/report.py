"""A memory plan as text (one plan, or every config side by side) and as a stacked-bar chart."""

from __future__ import annotations

from shardtune.plan.planner import GPU_FIXED_RESERVE, GPU_HEADROOM_FRACTION, GiB, MemoryPlan, gb

# The forward/backward step's parts of per-GPU memory, as the plan lists and charts them.
PER_GPU_COMPONENTS = ("weights", "gradients", "optimizer", "activations", "buffers")
HOST_EXTRAS = (("pinned_rounding", "pinned-memory rounding"), ("resume", "a resume's loaded optimizer shards"),
               ("export", "the final export's gathered model"))


def format_plan(p: MemoryPlan) -> str:
    rows = [f"{p.model} ({p.params:,} params) on {p.hardware} ({p.world_size} GPUs) with {p.config}, "
            f"micro-batch {p.micro_batch} x {p.max_seq_length} tokens, checkpointing "
            f"{'on' if p.gradient_checkpointing else 'off'}, {p.mixed_precision} ({p.activation_mode})"]
    rows += [f"  {name:<12}{gb(p.per_gpu[name]):>12}" for name in (*PER_GPU_COMPONENTS, "total")]
    if p.phases:  # the total is the largest phase's; the components above are forward/backward's
        phases = [f"{name} {gb(parts['total'])}{' (peak)' if name == p.peak_phase else ''}"
                  for name, parts in p.phases.items()]
        rows.append("  per phase: " + ", ".join(phases))
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
    header = (f"{'config':<30}" + "".join(f"{c:>13}" for c in (*PER_GPU_COMPONENTS, "total"))
              + f"{'host/node':>13}  fits")
    lines = [header]
    for p in plans:
        cells = "".join(f"{p.per_gpu[c] / 1e9:>12.1f}G" for c in (*PER_GPU_COMPONENTS, "total"))
        lines.append(f"{p.config:<30}{cells}{p.host_ram_per_node / 1e9:>12.1f}G  {'yes' if p.fits else 'no'}")
    lines.append(f"usable per GPU: {gb(plans[0].capacity)}")
    return "\n".join(lines)


def write_chart(plans: list[MemoryPlan], path: str) -> None:
    """Stacked bars of the per-GPU components for each config, with the usable capacity as a line."""
    import matplotlib  # here only: the planner itself stays light

    matplotlib.use("Agg")  # no display on training nodes or CI
    import matplotlib.pyplot as plt

    figure, axes = plt.subplots(figsize=(max(6, 1.2 * len(plans)), 5))
    names = [p.config for p in plans]
    bottom = [0.0] * len(plans)
    for component in PER_GPU_COMPONENTS:
        values = [p.per_gpu[component] / 1e9 for p in plans]
        axes.bar(names, values, bottom=bottom, label=component)
        bottom = [b + v for b, v in zip(bottom, values, strict=True)]
    axes.axhline(plans[0].capacity / 1e9, color="black", linestyle="--", label="usable capacity")
    axes.set_ylabel("GB per GPU")
    axes.set_title(f"{plans[0].model} on {plans[0].hardware}")
    axes.tick_params(axis="x", labelrotation=45)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path, format="png")
    plt.close(figure)
