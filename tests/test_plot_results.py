"""`benchmarks/plot_results.py` on the committed JSON: every PNG written, the same bytes twice, a missing JSON
skipped, and the values it draws equal to those the benchmark scripts summarised in the same files."""

from __future__ import annotations

import importlib.util
import json
import shutil
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
RESULTS = ROOT / "benchmarks" / "results"
PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"
EXPECTED = {
    "qlora_throughput.png",
    "probe_boundary.png",
    "ragged_throughput.png",
    "noise_schedule_run.png",
    "time_to_target.png",
}


def _load_script():
    spec = importlib.util.spec_from_file_location("plot_results", ROOT / "benchmarks" / "plot_results.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


plot_results = _load_script()


def read(name: str) -> dict:
    return json.loads((RESULTS / name).read_text())


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    out = tmp_path_factory.mktemp("plots")
    return out, plot_results.main(["--results", str(RESULTS), "--out", str(out)])


def test_every_png_is_written_small_and_non_empty(written):
    out, paths = written
    assert {path.name for path in paths} == EXPECTED
    for path in paths:
        assert path.parent == out
        data = path.read_bytes()
        assert data.startswith(PNG_SIGNATURE), path.name
        assert 10_000 < len(data) < 150 * 1024, (path.name, len(data))


def test_a_missing_json_is_skipped_and_named_and_the_rest_drawn_to_the_same_bytes(written, tmp_path, capsys):
    results = tmp_path / "results"
    results.mkdir()
    shutil.copy(RESULTS / plot_results.QLORA, results)
    paths = plot_results.main(["--results", str(results), "--out", str(tmp_path / "plots")])
    assert [path.name for path in paths] == ["qlora_throughput.png"]
    printed = capsys.readouterr().out
    assert f"skipped probe_boundary.png: no {', '.join(plot_results.PROBES)}" in printed
    out, _ = written
    assert paths[0].read_bytes() == (out / "qlora_throughput.png").read_bytes()


def test_best_tokens_per_second_is_the_benchmark_summary():
    report = read(plot_results.QLORA)
    pair, speed = plot_results.best_plain(report)
    assert (pair, speed) == (
        report["summary"]["best_plain"],
        report["summary"]["best_plain_tokens_per_second"],
    )
    assert speed == max(plot_results.plain_tokens_per_second(report).values())


def test_ragged_ratios_of_plain_arms_are_the_benchmark_summary():
    # The summary's ratios use the steady speed for AdaptiveBatch arms; for plain arms both use the steps after
    # the first, so the script's ratios must equal the summary's in each run.
    forward, reverse = (read(name) for name in plot_results.RAGGED)
    speeds = plot_results.ragged_speeds(forward, reverse)
    plain = [run["arm"] for run in forward["runs"] if run["adaptive_batch"] is None]
    assert len(plain) == 5
    for arm in plain:
        in_forward, in_reverse, _ = plot_results.ragged_ratios(speeds, arm, "random")
        assert in_forward == pytest.approx(forward["summary"][arm]["over_random"], rel=1e-12)
        assert in_reverse == pytest.approx(reverse["summary"][arm]["over_random"], rel=1e-12)


def test_medians_to_target_are_the_benchmark_summaries():
    first = read(plot_results.TIME_TO_TARGET[0])["summary"]
    medians = {
        arm: plot_results.median_to_target(times)
        for arm, times in plot_results.seconds_to_target(first["table"]).items()
    }
    assert medians == {arm: row["median_seconds_to_target"] for arm, row in first["by_arm"].items()}
    best = plot_results.best_fixed_median(medians)
    assert best == first["best_fixed_seconds"]
    assert medians["noise"] / best == pytest.approx(first["noise_over_best_fixed"], rel=1e-12)

    rerun = read(plot_results.TIME_TO_TARGET[1])
    medians = {
        arm: plot_results.median_to_target(times)
        for arm, times in plot_results.seconds_to_target(rerun["table"]).items()
    }
    assert medians == rerun["median_seconds_to_target"]
    assert medians["noise"] / plot_results.best_fixed_median(medians) == pytest.approx(
        rerun["over_fixed64"]["noise"], rel=1e-12
    )
