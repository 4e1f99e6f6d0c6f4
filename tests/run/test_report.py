"""The run report: plots from a synthetic run directory, the markdown, clear errors."""

from __future__ import annotations

import json
import math
import struct

import pytest

pytest.importorskip("matplotlib")

from grpo.config import loading as config_module  # noqa: E402
from grpo.config.schema import Config  # noqa: E402
from grpo.run.eval_results import EvalResult, append_results  # noqa: E402
from grpo.run.report import ReportError, build_report, figures  # noqa: E402
from grpo.run.run_files import read_metrics  # noqa: E402

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
BASE_PLOTS = {
    "reward",
    "rewards_per_function",
    "completion_length",
    "entropy",
    "clip_ratio",
    "frac_reward_zero_std",
}


def _metrics(steps: int, kl: bool) -> list[dict]:
    rows = []
    for s in range(1, steps + 1):
        p = s / steps
        row = {
            "step": s,
            "reward": 0.2 + 0.7 * p,
            "reward_std": 0.3 * (1 - p) + 0.05,
            "rewards/arithmetic_correct/mean": 0.1 + 0.8 * p,
            "rewards/arithmetic_format/mean": 0.3 + 0.6 * p,
            "frac_reward_zero_std": 0.1 + 0.5 * p,
            "entropy": 1.5 - p,
            "clip_ratio/low_mean": 0.001 * s,
            "clip_ratio/high_mean": 0.0005 * s,
            "clip_ratio/region_mean": 0.0015 * s,
            "completions/mean_length": 120 - 40 * p,
            "completions/clipped_ratio": 0.2 * (1 - p),
            "loss": 0.01,
            "grad_norm": 0.5,
            "learning_rate": 1e-6,
            "num_tokens": 1000 * s,
            "time/step": 2.0,
            "time/generate": 1.5,
            "time/update": 0.5,
            "tokens_per_second": 500.0,
        }
        if kl:
            row["kl"] = 0.001 * s
        rows.append(row)
    return rows


def _eval(label, step, temperature, correct, formatted, n=200):
    samples = [
        {
            "prompt": "Calculate 28 * 3 + 43.",
            "completion": "28 * 3 = 84\n84 + 43 = 127\nAnswer: 127",
            "answer": 127,
            "predicted": 127,
            "correct": True,
        }
    ]
    counts = {
        "correct": [correct, n],
        "formatted": [formatted, n],
        "correct among formatted": [correct, formatted],
    }
    return EvalResult(label, step, temperature, n, counts, correct / n, {}, 50.0, 0.0, samples)


def _run_dir(tmp_path, steps=30, kl=True, evals=True, samples=True):
    run = tmp_path / "run"
    run.mkdir()
    with open(run / "metrics.jsonl", "w") as f:
        for row in _metrics(steps, kl):
            f.write(json.dumps(row) + "\n")
    cfg = Config(output_dir=str(run))
    cfg.model.name = "tiny"
    cfg.algorithm.beta = 0.04 if kl else 0.0
    config_module.save(cfg, run / "config.yaml")
    if evals:
        append_results(
            run / "eval.jsonl", [_eval("before", 0, 0.0, 8, 8), _eval("before", 0, 1.0, 91, 106)]
        )
        append_results(
            run / "eval.jsonl",
            [_eval("step 15", 15, 0.0, 120, 150), _eval("step 15", 15, 1.0, 110, 160)],
        )
        append_results(
            run / "eval.jsonl",
            [_eval("after", steps, 0.0, 194, 200), _eval("after", steps, 1.0, 191, 199)],
        )
    if samples:
        with open(run / "samples.jsonl", "w") as f:
            for s in (10, 20, 30):
                f.write(
                    json.dumps(
                        {
                            "step": s,
                            "prompt": "Calculate 28 * 3 + 43.",
                            "completion": f"step {s} work\nAnswer: 127",
                            "reward": s / 30,
                        }
                    )
                    + "\n"
                )
    return run


def _png_size(path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == PNG_SIGNATURE, f"{path.name} is not a PNG"
    assert data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


@pytest.mark.parametrize("kl", [True, False])
def test_build_report_writes_plots_and_markdown(tmp_path, kl):
    run = _run_dir(tmp_path, kl=kl)
    path = build_report(run)
    assert path == run / "report.md"

    expected = BASE_PLOTS | {"eval_accuracy"} | ({"kl"} if kl else set())
    written = {p.stem for p in (run / "plots").glob("*.png")}
    assert written == expected
    for name in expected:
        width, height = _png_size(run / "plots" / f"{name}.png")
        assert width >= 600 and height >= 300  # readable at 100 dpi
        assert (run / "plots" / f"{name}.png").stat().st_size > 5000  # something was drawn

    text = path.read_text()
    for name in expected:
        assert f"](plots/{name}.png)" in text
    assert "](plots/kl.png)" in text if kl else "kl.png" not in text
    # the before/after table, with the seed's numbers
    assert "| decoding | correct (before) | correct (after) |" in text
    assert "| greedy | 8/200 (4.0%) | 194/200 (97.0%) |" in text
    assert "91/106" in text and "191/199" in text
    table = text.split("## Held-out evaluation")[1].split("### Held-out examples")[0]
    assert "120/200" not in table  # the "step 15" evaluation is in the plot, not the table
    # summary and first/last 10%
    assert "`tiny`" in text
    assert "1m 00s" in text  # 30 steps x 2.0 s
    assert "500 (prompt + completion tokens" in text  # 30000 tokens / 60 s
    first_last = next(line for line in text.splitlines() if line.startswith("| reward |"))
    cells = [c.strip() for c in first_last.strip("|").split("|")]
    # steps 1-3 and 28-30 of reward = 0.2 + 0.7 * s / 30
    assert float(cells[1]) == pytest.approx(0.2 + 0.7 * 2 / 30, rel=1e-3)
    assert float(cells[2]) == pytest.approx(0.2 + 0.7 * 29 / 30, rel=1e-3)
    assert ("| kl |" in text) == kl
    # samples from the start and end of training
    assert "Start of training (step 10)" in text and "End of training (step 30)" in text
    assert "step 30 work" in text and "step 20 work" not in text


def test_report_without_optional_files(tmp_path):
    run = _run_dir(tmp_path, steps=5, kl=False, evals=False, samples=False)
    (run / "config.yaml").unlink()
    text = build_report(run).read_text()
    assert {p.stem for p in (run / "plots").glob("*.png")} == BASE_PLOTS
    assert "Held-out evaluation" not in text and "Sample completions" not in text
    assert "| reward |" in text


def test_missing_or_empty_metrics_is_a_clear_error(tmp_path):
    with pytest.raises(ReportError, match="metrics.jsonl does not exist"):
        build_report(tmp_path)
    (tmp_path / "metrics.jsonl").write_text("\n")
    with pytest.raises(ReportError, match="is empty"):
        build_report(tmp_path)
    with pytest.raises(ReportError, match="does not exist"):
        build_report(tmp_path / "nope")


def test_resumed_run_keeps_the_last_record_of_a_step(tmp_path):
    rows = _metrics(4, kl=False)
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in rows[:3] + [dict(rows[1], reward=9.0)] + rows[2:]:
            f.write(json.dumps(row) + "\n")
    metrics = read_metrics(tmp_path)
    assert [m["step"] for m in metrics] == [1, 2, 3, 4]
    assert metrics[1]["reward"] == 9.0


def test_figures_have_titles_labels_and_legends():
    metrics = _metrics(30, kl=True)
    metrics[3]["reward"] = math.nan  # a missing value is skipped, not plotted
    evals = [_eval("before", 0, 0.0, 8, 8), _eval("after", 30, 0.0, 194, 200)]
    figs = figures(metrics, evals)
    assert set(figs) == BASE_PLOTS | {"kl", "eval_accuracy"}
    ylabels = {}
    for name, fig in figs.items():
        ax = fig.axes[0]
        assert ax.get_title(), name
        assert ax.get_xlabel() == "step", name
        assert ax.get_ylabel(), name
        assert ax.get_legend() is not None, name
        ylabels[name] = ax.get_ylabel()
    assert ylabels["reward"] == "reward"
    assert ylabels["completion_length"] == "tokens"
    assert "nats/token" in ylabels["kl"] and "nats/token" in ylabels["entropy"]
    assert "fraction" in ylabels["frac_reward_zero_std"] and "fraction" in ylabels["clip_ratio"]
    # the clipped ratio sits on a second y axis
    assert "fraction" in figs["completion_length"].axes[1].get_ylabel()
    # reward: the mean line plus a ± std band
    reward_ax = figs["reward"].axes[0]
    assert len(reward_ax.collections) == 1
    assert any("reward_std" in t.get_text() for t in reward_ax.get_legend().get_texts())
    # eval accuracy vs step: correct and formatted for the one temperature
    eval_ax = figs["eval_accuracy"].axes[0]
    correct_line = eval_ax.get_lines()[0]
    assert list(correct_line.get_xdata()) == [0, 30]
    assert list(correct_line.get_ydata()) == pytest.approx([0.04, 0.97])


def test_single_eval_step_has_no_accuracy_plot():
    figs = figures(
        _metrics(5, kl=False), [_eval("before", 0, 0.0, 8, 8), _eval("before", 0, 1.0, 9, 9)]
    )
    assert "eval_accuracy" not in figs


def test_reward_in_tens_is_the_seeds_ten_step_means():
    from grpo.run.report import reward_in_tens

    metrics = [{"step": s, "reward": 0.5 if s <= 10 else 1.0} for s in range(1, 26)]
    # step 4 has no reward: blocks are of ten steps that have one
    metrics[3]["reward"] = float("nan")
    assert reward_in_tens(metrics) == [
        (1, 11, pytest.approx((9 * 0.5 + 1.0) / 10)),
        (12, 21, 1.0),
        (22, 25, 1.0),
    ]


def test_plots_apart_writes_the_report_at_once_and_a_fresh_process_draws_the_plots(tmp_path):
    import time

    from grpo.run import report

    run = _run_dir(tmp_path, kl=False)
    path = build_report(run, plots_apart=True)
    expected = BASE_PLOTS | {"eval_accuracy"}
    text = path.read_text()
    assert all(f"](plots/{name}.png)" in text for name in expected)  # listed before drawn
    marker = run / "plots" / report.RENDERING
    deadline = time.monotonic() + 120
    while marker.exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not marker.exists(), "the renderer did not finish"
    assert not (run / "plots" / report.RENDER_LOG).exists()
    assert {p.stem for p in (run / "plots").glob("*.png")} == expected
    assert not list((run / "plots").glob(".*.tmp-*"))  # each PNG renamed into place
    for name in expected:
        assert _png_size(run / "plots" / f"{name}.png")[0] >= 600


def test_a_renderer_that_fails_says_why_in_render_log(tmp_path):
    from grpo.run import report

    run = _run_dir(tmp_path, steps=3, kl=False, evals=False, samples=False)
    (run / "metrics.jsonl").write_text("not json\n")
    assert report.main([str(run)]) == 1
    assert "not valid JSON" in (run / "plots" / report.RENDER_LOG).read_text()
    assert not (run / "plots" / report.RENDERING).exists()


def test_plots_apart_without_matplotlib_writes_the_report_saying_so(tmp_path, monkeypatch):
    from grpo.run import report

    monkeypatch.setattr(report, "_draws_plots", lambda: False)
    run = _run_dir(tmp_path, steps=5, kl=False, evals=False, samples=False)
    text = build_report(run, plots_apart=True).read_text()
    assert "No plots: matplotlib is not installed" in text and "](plots/" not in text
    assert not (run / "plots").exists()  # no renderer started
