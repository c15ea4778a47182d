"""``cascade bench``'s reports: ``bench.md`` (and ``batch.md``), ``bench.json`` and the plots."""
from __future__ import annotations

import json
import resource
from pathlib import Path

from cascade.repetition import LOOP_THRESHOLD, NGRAM
from cascade.tools.bench_records import ConfigReport, Sample
from cascade.tools.timing import Spread, busy_warning, machine_line


def markdown(reports: list[ConfigReport], config: dict) -> str:
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    modes = list(dict.fromkeys(r.mode for r in reports))
    lines = [
        (machine_line(config["machine"]) + " " if config.get("machine") else "") +
        f"Topology `{config['topology']}`, {config['prompts']} prompts x {config['repeats']} repeat(s), "
        f"{config['max_new_tokens']} new tokens, {' and '.join(modes)}; all configurations"
        f"{' in both modes' if len(modes) > 1 else ''} interleaved in one process "
        f"(peak RSS of the process: {rss:.0f} MiB, torch threads: {config.get('threads', '?')}). Repetition: share "
        f"of a continuation's tokens that close a {NGRAM}-gram already in it, median over prompts; a continuation is "
        f"a loop at >= {LOOP_THRESHOLD}. Speedup vs plain: median over prompts, 95% bootstrap CI in brackets"
        + (f"; by repeat: the same from each repeat's runs alone, median (min–max) over the {config['repeats']} "
           f"repeats." if config.get("repeats", 1) > 1 else
           "; one repeat, so no range over repeats to show how steady the machine was (--repeats 3 gives one).")
        + " Speedup vs cascade:authority: the same over cascade with the authority alone (its own forward, no "
          "drafting), measured in the same run: what drafting itself bought.",
        "",
    ]
    # the llama.cpp row's sampler and file, or the one line saying why it was skipped
    lines += [f"- {line}" for line in config.get("llama_cpp", [])] + ([""] if config.get("llama_cpp") else [])
    if config.get("left_out"):
        lines += ["Left out, as they cannot apply to this topology:", ""]
        lines += [f"- {note}" for note in config["left_out"]] + [""]
    if len(modes) > 1:
        lines += _side_by_side(reports, modes) + [""]
    for mode in modes:
        rows = [r for r in reports if r.mode == mode]
        lines += [f"### {mode}", "", _nonloop_line(rows), _exactness_line(rows, config), ""]
        warning = busy_warning(_spreads(rows))
        if warning:
            lines += [f"**{warning}**", ""]
        by_repeat = any(len(r.speedup_by_repeat) > 1 for r in rows)
        lines += [
            "| configuration | tokens/s (median, 95% CI) | speedup vs plain | speedup vs cascade:authority | "
            + ("speedup by repeat | " if by_repeat else "")
            + "speedup, non-loop prompts | repetition | authority passes/token | predicted speedup | "
              "measured ÷ predicted | exactness |",
            "|---" * (11 if by_repeat else 10) + "|",
        ]
        for r in rows:
            pred = f"{r.predicted_speedup:.2f}x" if r.predicted_speedup else "—"
            share = f"{r.measured_over_predicted:.2f}" if r.measured_over_predicted else "—"
            repeats = f" {Spread.of(r.speedup_by_repeat).format(unit='x')} |" if by_repeat else ""
            lines.append(
                f"| {r.name} | {r.tokens_per_second_median:.1f} ({r.tokens_per_second_ci[0]:.1f}–"
                f"{r.tokens_per_second_ci[1]:.1f}) | {r.speedup_median:.2f}x ({r.speedup_ci[0]:.2f}–"
                f"{r.speedup_ci[1]:.2f}) | {_over_authority(r)} |{repeats} {_x(r.speedup_nonloop_median)} | {r.repetition_median:.2f} "
                f"| {r.authority_passes_per_token:.3f} | {pred} | {share} | {_exactness_cell(r)} |"
            )
        lines += ["", f"Acceptance per edge (cascade configurations, {mode}):", ""]
        for r in rows:
            if r.acceptance:
                accs = ", ".join(f"{k} {v:.2f}" for k, v in r.acceptance.items())
                best = f" (prediction's path: {' -> '.join(r.predicted_path)})" if r.predicted_path else ""
                lines.append(f"- {r.name}: {accs}{best}")
        lines.append("")
    return "\n".join(lines)


def _spreads(rows: list[ConfigReport]) -> dict[str, Spread]:
    """What says whether the machine was steady over the repeats of one mode: plain decoding's
    tokens/s, and each configuration's speedup over plain, per repeat."""
    spreads = {f"{r.name} speedup": Spread.of(r.speedup_by_repeat) for r in rows
               if r.name != "plain" and r.speedup_by_repeat}
    plain = next((r for r in rows if r.name == "plain" and r.tokens_per_second_by_repeat), None)
    return ({"plain tok/s": Spread.of(plain.tokens_per_second_by_repeat)} if plain else {}) | spreads


def _over_authority(r: ConfigReport) -> str:
    if r.speedup_over_authority_median is None:
        return "—"
    lo, hi = r.speedup_over_authority_ci
    return f"{r.speedup_over_authority_median:.2f}x ({lo:.2f}–{hi:.2f})"


def _x(value: float | None) -> str:
    return "—" if value is None else f"{value:.2f}x"


def _nonloop_line(rows: list[ConfigReport]) -> str:
    n = rows[0].nonloop_prompts if rows else 0
    plain = next((r for r in rows if r.name == "plain"), None)
    rep = f"{plain.repetition_median:.2f}" if plain else "?"
    return (f"Plain decoding's repetition: {rep} (median); {n} prompt(s) have a plain continuation that is not "
            f"a loop (repetition < {LOOP_THRESHOLD}): the non-loop speedup is the median over those.")


def _exactness_line(rows: list[ConfigReport], config: dict) -> str:
    if rows and rows[0].mode == "greedy":
        return "Exactness: every output compared token by token with plain greedy decoding's."
    check = next((r.distribution for r in rows if r.distribution is not None), None)
    if check is None:
        return "Exactness: **not checked** (no distribution check in this run)."
    return (f"Exactness by distribution: the first {check.tokens} generated tokens after the first "
            f"{check.prompt_tokens} tokens of prompt {check.prompt} (a short prefix whose next token is uncertain "
            f"among a few common ones), {check.draws} seeded draws from each configuration against {check.draws} "
            f"from plain sampling of the authority; at each position a Pearson chi-square test of homogeneity "
            f"(outcomes with expected count < 5 pooled); p = {check.tokens} x the smallest (Bonferroni); a "
            f"configuration fails if p <= {check.bound:g}. TV: empirical total variation of the first token's two "
            f"samples (noise alone gives a few hundredths).")


def _exactness_cell(r: ConfigReport) -> str:
    if r.name == "plain":
        return "baseline"
    if r.name == "llama.cpp":
        return "not checked (another program: llama.cpp's kernels and draws)"
    if r.mode == "greedy":
        if not r.mismatches:
            return "identical"
        real = [i for i in r.mismatches if i not in r.near_ties]
        ties = f"near-tie rounding on prompts {r.near_ties}" if r.near_ties else ""
        return f"**DIFFERS** (prompts {real}){'; ' + ties if ties else ''}" if real else ties
    if r.distribution is None:
        return "not checked" + (" (transformers' own sampler)" if r.name.startswith("hf-") else "")
    p = f"{r.distribution.p_value:.2g}"
    tv = f"TV {r.distribution.total_variation:.2f}"
    return f"p = {p}, {tv}" if r.distribution.passed else f"**FAILS** (p = {p}, {tv})"


def _side_by_side(reports: list[ConfigReport], modes: list[str]) -> list[str]:
    """One row per configuration, each mode's speedups (over plain decoding and over the authority
    alone) and repetition next to each other."""
    head = " | ".join(f"speedup, {m} | vs cascade:authority, {m} | non-loop, {m} | repetition, {m}" for m in modes)
    lines = [f"| configuration | {head} |", "|---" * (1 + 4 * len(modes)) + "|"]
    by = {(r.mode, r.name): r for r in reports}
    for name in dict.fromkeys(r.name for r in reports):
        cells = []
        for m in modes:
            r = by.get((m, name))
            cells += ([_x(r.speedup_median), _x(r.speedup_over_authority_median), _x(r.speedup_nonloop_median),
                       f"{r.repetition_median:.2f}"] if r else ["—"] * 4)
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def write_report(out: Path, reports: list[ConfigReport], samples: list[Sample], config: dict) -> None:
    from dataclasses import asdict

    out.mkdir(parents=True, exist_ok=True)
    raw = [asdict(s) | {"stats": s.stats.to_dict() if s.stats is not None else None} for s in samples]
    rows = [asdict(r) | {"exact": r.exact} for r in reports]
    for row, r in zip(rows, reports):
        if r.distribution is not None:
            row["distribution"]["passed"] = r.distribution.passed
    (out / "bench.json").write_text(json.dumps({"config": config, "reports": rows, "samples": raw}, indent=1))
    (out / "bench.md").write_text(markdown(reports, config))
    try:
        import matplotlib
    except ImportError:
        return
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    modes = list(dict.fromkeys(r.mode for r in reports))
    _speedup_plot(plt, out / "speedup.png", reports, modes)
    cascade_reports = [r for r in reports if r.acceptance_by_position]
    if cascade_reports:
        _acceptance_plot(plt, out / "acceptance.png", cascade_reports, modes)
        _time_plot(plt, out / "time_breakdown.png", cascade_reports, modes)


def _speedup_plot(plt, path: Path, reports: list[ConfigReport], modes: list[str]) -> None:
    """Per mode: each configuration's speedup over all prompts (with its 95% CI) and over the
    non-loop prompts, its text's repetition written beside the bars."""
    fig, axes = plt.subplots(1, len(modes), figsize=(7 * len(modes), 0.45 * len(reports) / len(modes) + 2),
                             sharey=True, squeeze=False)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in reports if r.mode == mode]
        y = list(range(len(rows)))
        ax.barh([i - 0.2 for i in y], [r.speedup_median for r in rows], height=0.4,
                xerr=[[r.speedup_median - r.speedup_ci[0] for r in rows], [r.speedup_ci[1] - r.speedup_median for r in rows]],
                color=["tab:blue" if r.name.startswith("cascade") else "tab:gray" for r in rows], label="all prompts")
        ax.barh([i + 0.2 for i in y], [r.speedup_nonloop_median or 0.0 for r in rows], height=0.4,
                color="tab:orange", label=f"{rows[0].nonloop_prompts} non-loop prompts")
        for i, r in zip(y, rows):
            ax.text(max(r.speedup_ci[1], r.speedup_nonloop_median or 0) + 0.05, i,
                    f"rep. {r.repetition_median:.2f}", va="center", fontsize=7)
        ax.set_yticks(y, [r.name for r in rows])
        ax.axvline(1.0, color="black", lw=0.8)
        ax.set_title(mode)
        ax.set_xlabel("speedup over plain decoding (median over prompts)")
        ax.legend(fontsize=7, loc="lower right")
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _acceptance_plot(plt, path: Path, cascade_reports: list[ConfigReport], modes: list[str]) -> None:
    fig, axes = plt.subplots(1, len(modes), figsize=(6 * len(modes), 3.5), squeeze=False, sharey=True)
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in cascade_reports if r.mode == mode]
        full = max(rows, key=lambda r: len(r.acceptance_by_position))
        for k, rates in full.acceptance_by_position.items():
            ax.plot(range(1, len(rates) + 1), rates, marker="o", label=k)
        ax.set_title(f"acceptance by draft position: {full.name} ({mode})", fontsize=9)
        ax.set_xlabel("draft position")
        ax.set_ylim(0, 1.05)
        ax.legend(fontsize=8)
    axes[0][0].set_ylabel("P(accept | previous accepted)")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def _time_plot(plt, path: Path, cascade_reports: list[ConfigReport], modes: list[str]) -> None:
    fig, axes = plt.subplots(1, len(modes), figsize=(8 * len(modes), 4), squeeze=False, sharey=True)
    levels = sorted({k for r in cascade_reports for k in r.level_seconds_per_token})
    for ax, mode in zip(axes[0], modes):
        rows = [r for r in cascade_reports if r.mode == mode]
        left = [0.0] * len(rows)
        for level in levels + ["orchestration"]:
            vals = [1000 * (r.orchestration_seconds_per_token if level == "orchestration"
                            else r.level_seconds_per_token.get(level, 0.0)) for r in rows]
            ax.barh([r.name for r in rows], vals, left=left, label=level)
            left = [a + b for a, b in zip(left, vals)]
        ax.set_title(mode)
        ax.set_xlabel("milliseconds per committed token")
        ax.legend(fontsize=8)
    axes[0][0].invert_yaxis()
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def batch_markdown(rows: list[dict], topology: str, max_new_tokens: int, mode: str = "greedy", check=None,
                   threads: int | None = None, machine: dict | None = None) -> str:
    r0 = rows[0] if rows else {}
    lines = [(machine_line(machine) + " " if machine else "") +
             f"Topology `{topology}`, {mode}, {max_new_tokens} new tokens per request; at each concurrency B the same "
             f"{r0.get('requests', '?')} requests (more if B is larger) are served B at a time: plain = transformers "
             f"`generate` of the authority in batches of B, cascade = `generate(..., batch_size=B)` (continuous "
             f"batching). Latency: mean per request, from the start of its batch (plain) or its joining (cascade) to "
             f"its end. Ratios are the median of {r0.get('repeats', 1)} side-by-side repeats (range in brackets). "
             f"Repetition: median over requests of the share of tokens closing a {NGRAM}-gram already in the text. "
             f"Torch threads: {threads if threads is not None else '?'}.", ""]
    warning = busy_warning(_batch_spreads(rows))
    if warning:
        lines += [f"**{warning}**", ""]
    lines += ["| concurrency B | plain tokens/s | cascade tokens/s | cascade ÷ plain | plain latency (s) | "
              "cascade latency (s) | repetition, plain | repetition, cascade |", "|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in rows:
        spread = f" [{r['ratio_min']:.2f}–{r['ratio_max']:.2f}]" if r.get("repeats", 1) > 1 else ""
        lines.append(f"| {r['batch_size']} | {r['plain_tokens_per_second']:.1f} | {r['cascade_tokens_per_second']:.1f} "
                     f"| {r['ratio']:.2f}x{spread} | {r['plain_latency_s']:.2f} | {r['cascade_latency_s']:.2f} "
                     f"| {r['plain_repetition']:.2f} | {r['cascade_repetition']:.2f} |")
    if check is not None:
        verdict = "passes" if check.passed else "**FAILS**"
        lines += ["", f"Exactness by distribution ({check.config}): the first {check.tokens} generated tokens after the "
                      f"first {check.prompt_tokens} tokens of prompt {check.prompt}, {check.draws} draws against as many "
                      f"of plain sampling, per-position chi-square of homogeneity, Bonferroni: p = {check.p_value:.2g} "
                      f"(bound: p > {check.bound:g}): {verdict}."]
    elif mode == "greedy":
        lines += ["", "Exactness: not checked in this mode; `cascade bench` without --batch-sizes compares every "
                      "output with plain decoding's, token by token."]
    return "\n".join(lines) + "\n"


def _batch_spreads(rows: list[dict]) -> dict[str, Spread]:
    """Per concurrency, over the repeats: the throughput ratio and plain decoding's tokens/s (rows
    written before the per-repeat tokens/s were recorded have only the ratios)."""
    spreads = {}
    for r in rows:
        if r.get("ratios"):
            spreads[f"B={r['batch_size']} cascade ÷ plain"] = Spread.of(r["ratios"])
        if r.get("plain_tokens_per_second_by_repeat"):
            spreads[f"B={r['batch_size']} plain tok/s"] = Spread.of(r["plain_tokens_per_second_by_repeat"])
    return spreads
