"""Figures and checks of benchmarks/gpu_offload.py: output comparisons, bus use, overlap, the table.

Output checks (first prefill's logits of every case, kept from the warm-up round):

- bigmodel vs accelerate, same setup (dispatch / cpu_offload): **bit-exact** (``torch.equal``).
  Both build the model on ``meta`` and load the same checkpoint, so the same kernels see the same
  numbers; only where the weights lived in between differs.
- every offloaded case vs ``floor`` (all on the accelerator): **within tolerance**.  The floor
  builds its model on the device, where RoPE's ``inv_freq`` may differ from the CPU-computed one
  in the last ulp; the check is that the mean absolute logit difference stays under 2 % of the
  mean absolute logit (a stale or misplaced weight moves it by the logits' own size).  The share
  of positions predicting the same next token is reported too, not checked: with random weights
  the top logits are close, so last-ulp differences can swap them.

Bus use and overlap (per offloaded case; B = bytes the case brings to the device per forward,
P = measured pinned host→device bandwidth, F = the floor's time for the same forward):

- ``h2d_GBps``: B / forward time: the bandwidth the offloaded forward achieves;
- ``fraction_of_pinned_bus``: that over P;
- ``overlap``: (B/P + F - forward time) / min(B/P, F), clipped to [0, 1]: 0 when the copies and
  the compute run one after the other, 1 when the shorter of the two is hidden entirely.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

GB = 10**9
MEAN_ABS_SHARE = 0.02
EXACT_PAIRS = [("bigmodel dispatch", "accelerate dispatch"), ("bigmodel cpu_offload", "accelerate cpu_offload"),
               ("bigmodel dispatch", "bigmodel cpu_offload")]


def compare_outputs(logits: dict[str, torch.Tensor]) -> list[dict]:
    """The output checks above, for the cases that produced logits."""
    checks = []
    for a, b in EXACT_PAIRS:
        if a in logits and b in logits:
            same = logits[a].shape == logits[b].shape and torch.equal(logits[a], logits[b])
            diff = (logits[a].float() - logits[b].float()).abs().max().item() if not same else 0.0
            checks.append({"check": f"{a} == {b}", "rule": "bit-exact", "passed": bool(same), "max_abs_diff": diff})
    floor = logits.get("floor")
    for name, value in logits.items():
        if name == "floor" or floor is None:
            continue
        a, b = value.float(), floor.float()
        agreement = (a.argmax(-1) == b.argmax(-1)).float().mean().item()
        mean_abs = (a - b).abs().mean().item()
        scale = b.abs().mean().item()
        checks.append({
            "check": f"{name} ~ floor", "rule": f"mean |diff| <= {MEAN_ABS_SHARE:.0%} of mean |logit|",
            "passed": a.shape == b.shape and mean_abs <= MEAN_ABS_SHARE * scale,
            "top1_agreement": agreement, "mean_abs_diff": mean_abs, "max_abs_diff": (a - b).abs().max().item(),
            "mean_abs_logit": scale,
        })
    return checks


def overlap(moved: int, seconds: float, floor_seconds: float | None, pinned_Bps: float | None) -> float | None:
    """Share of the shorter of (copy time at the pinned bandwidth, floor compute) hidden by the other."""
    if not (moved and seconds and floor_seconds and pinned_Bps):
        return None
    copy = moved / pinned_Bps
    hidden = copy + floor_seconds - seconds
    return max(0.0, min(1.0, hidden / min(copy, floor_seconds)))


def derive(medians: dict, bus: dict, meta: dict) -> dict:
    """Per offloaded case: bandwidth during forwards, its share of the pinned bus, overlap, speed-ups."""
    key = f"prefill_{meta['prefill'][0]}_s"
    floor, pinned, derived = medians.get("floor", {}), bus.get("pinned_h2d_Bps"), {}
    for name, values in medians.items():
        if name == "floor":
            continue
        moved = meta["offloaded_bytes"][name.split(" ", 1)[-1]]
        item = {"offloaded_bytes": moved}
        for label, k in (("decode", "decode_step_s"), ("prefill", key)):
            seconds = values.get(k)
            if not seconds:
                continue
            item[f"{label}_h2d_GBps"] = moved / seconds / GB
            if pinned:
                item[f"{label}_fraction_of_pinned_bus"] = moved / seconds / pinned
            item[f"{label}_overlap"] = overlap(moved, seconds, floor.get(k), pinned)
            if k in floor:
                item[f"{label}_vs_floor"] = seconds / floor[k]
        rival = medians.get(name.replace("bigmodel", "accelerate")) if name.startswith("bigmodel") else None
        for k, label in ((key, "prefill"), ("decode_step_s", "decode")):
            if rival and k in rival and k in values:
                item[f"{label}_speedup_vs_accelerate"] = rival[k] / values[k]
        derived[name] = item
    return derived


def _cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else format(value, fmt)


def table(summary: dict) -> str:
    meta, medians, bus, derived = summary["meta"], summary["medians"], summary["bus"], summary["derived"]
    prefills = meta["prefill"]
    head = ["case", "offloaded GB"] + [f"prefill {n} (ms)" for n in prefills] + [
        "decode step (ms)", "decode H2D GB/s", "% pinned bus", "decode overlap", "prefill overlap",
        "x faster than accelerate (prefill / decode)"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, values in medians.items():
        item = derived.get(name, {})
        row = [name, _cell(item.get("offloaded_bytes", 0) / GB, ".2f")]
        row += [_cell(values.get(f"prefill_{n}_s", None) and values[f"prefill_{n}_s"] * 1e3, ".1f") for n in prefills]
        row.append(_cell(values.get("decode_step_s") and values["decode_step_s"] * 1e3, ".1f"))
        row.append(_cell(item.get("decode_h2d_GBps"), ".1f"))
        share = item.get("decode_fraction_of_pinned_bus")
        row.append(_cell(share and 100 * share, ".0f") + ("%" if share else ""))
        row.append(_cell(item.get("decode_overlap"), ".2f"))
        row.append(_cell(item.get("prefill_overlap"), ".2f"))
        ratios = [item[k] for k in ("prefill_speedup_vs_accelerate", "decode_speedup_vs_accelerate") if k in item]
        row.append(" / ".join(f"{r:.2f}" for r in ratios) if ratios else "-")
        lines.append("| " + " | ".join(row) + " |")
    for label in ("pinned", "pageable"):
        if f"{label}_h2d_Bps" in bus:
            lines.append(f"\n{label} host→device bandwidth (1 GiB copies): {bus[f'{label}_h2d_Bps'] / GB:.1f} GB/s")
    lines.append("\nOutput checks (first prefill's logits):\n")
    for check in summary.get("checks", []):
        figures = ", ".join(f"{k}={v:.4g}" for k, v in check.items() if isinstance(v, float))
        lines.append(f"- {'PASS' if check['passed'] else 'FAIL'} {check['check']} ({check['rule']}): {figures}")
    if not summary.get("checks"):
        lines.append("- none ran (no logits)")
    for name, error in summary["errors"].items():
        lines.append(f"\n{name}: {error.strip().splitlines()[-1]}")
    return "\n".join(lines)


def write(out: Path, summary: dict) -> None:
    (out / "gpu_offload.json").write_text(json.dumps(summary, indent=1, default=str))
    (out / "gpu_offload.md").write_text(table(summary) + "\n")
