"""Invariants 1, 2 and 6 under DDP: two CPU processes (gloo) train exactly as one process on the same plan, ranks
with one sample fewer, one rank's out-of-memory error (in TRL's SFTTrainer too, where the other rank is already
inside a collective of `compute_loss`) and steps cut by a token budget included, and nothing hangs. The gradient
noise scale is measured over the micro-batches of both ranks, as one process would measure it.

Two ranks and one process add in different orders: those are compared within helpers.py's ORDER_TOLERANCE (the worker
runs with its ORDER_ONLY settings). A retried run and the clean run at the size it settled on, and the two ranks of a
run, are compared bit for bit."""

import json
import re

import pytest
import torch
from helpers import regression_truth
from launch import assert_close_weights, assert_same_weights, launch

# under `pytest -n 2 --dist loadgroup`, one worker runs the tests that launch several processes, one after another
pytestmark = [pytest.mark.slow, pytest.mark.xdist_group("launch")]
NOISE_KEYS = ("adaptive_batch/noise_scale", "adaptive_batch/grad_norm_sq", "adaptive_batch/grad_variance")
# the padded layout of the runs with a fake out-of-memory error, which counts padded rows (tests/ddp_worker.py)
PADDED = {"WORKER_PADDED": "1"}


def test_a_forked_launch_runs_as_torchrun_runs_it_bit_for_bit(tmp_path):
    """launch.py forks its ranks from a fork server that imported the libraries once: the same run under torchrun
    itself gives the same logs, micro-batches, out-of-memory retries and weights, to the last bit."""
    forked, forked_weights = launch(tmp_path, "forked", "trainer", micro=2, world_size=2, fake_oom_rank=1)
    real, real_weights = launch(
        tmp_path, "torchrun", "trainer", micro=2, world_size=2, fake_oom_rank=1, via_torchrun=True
    )
    assert forked[1]["raised"], "the fake out-of-memory error never came"
    for name in ("rank", "world_size", "plan", "logs", "raised", "micro_batches"):
        assert [rank[name] for rank in forked] == [rank[name] for rank in real], name
    for mine, theirs in zip(forked_weights, real_weights):
        assert_same_weights(mine, theirs)


def test_a_forked_launch_whose_rank_fails_ends_with_that_ranks_error(tmp_path):
    """The launch of test_under_fsdp2_one_ranks_out_of_memory_ends_every_rank_with_the_error, forked: it ends (no
    rank left waiting) with the failing rank's traceback."""
    with pytest.raises(
        pytest.fail.Exception, match=r"(?s)rank \d ended with exit code 1:.*EngineOutOfMemoryError"
    ):
        launch(tmp_path, "oom", "fsdp2", micro=2, world_size=2, fake_oom_rank=1)


@pytest.mark.parametrize("kind", ["trainer", "stream", "stream_workers", "sft", "fsdp2"])
def test_two_ranks_train_exactly_as_one_process(tmp_path, kind):
    # FSDP2's reference is one process without it; a stream read by a DataLoader worker, the same stream without
    reference = {"fsdp2": "trainer", "stream_workers": "stream"}.get(kind, kind)
    single, single_weights = launch(tmp_path, "single", reference, 1, world_size=1)
    ranks, rank_weights = launch(tmp_path, "ddp", kind, micro=1, world_size=2)
    if kind.startswith("stream"):  # 40 samples: rank 0 reads them for both ranks, or each rank reads them all
        assert [rank["stream_reads"] for rank in ranks] == ([40, 0] if kind == "stream" else [40, 40])
    assert ranks[0]["world_size"] == 2
    assert ranks[0]["plan"] == ranks[1]["plan"] == single[0]["plan"]
    sizes = [log["adaptive_batch/effective_batch_size"] for log in ranks[0]["logs"]]
    assert sizes == [log["adaptive_batch/effective_batch_size"] for log in single[0]["logs"]]
    if not kind.startswith("stream"):  # (a stream's budget, max_steps x 4, leaves no odd remainder)
        assert any(
            size % 2 for size in sizes
        )  # a step whose shares differ by one sample (a row adding nothing)
    for key in ("adaptive_batch/samples_seen", "adaptive_batch/tokens_seen"):
        assert [log[key] for log in ranks[0]["logs"]] == [log[key] for log in single[0]["logs"]]
    if kind == "sft":
        assert [log["num_tokens"] for log in ranks[0]["logs"]] == [
            log["num_tokens"] for log in single[0]["logs"]
        ]
    assert_same_weights(rank_weights[0], rank_weights[1])  # the ranks agree
    assert_close_weights(rank_weights[0], single_weights[0])
    if kind == "fsdp2":  # the sharded gradient reaches the hooks averaged: not measured
        assert not any(key in log for log in ranks[0]["logs"] for key in NOISE_KEYS)
        return
    # micro-batches of one row: the same micro-batches (each rank's own, its rows that add nothing left out), so the
    # same noise estimates as one process (the step's label tokens counted over both ranks)
    for key in NOISE_KEYS:
        values = [log[key] for log in ranks[0]["logs"]]
        assert values == [log[key] for log in ranks[1]["logs"]], key
        assert values == pytest.approx([log[key] for log in single[0]["logs"]], rel=1e-9), key


def test_gradients_are_ddps_a_branch_no_rank_used_keeps_none_and_one_ranks_branch_is_averaged(tmp_path):
    """helpers.py's `Branches` on two ranks under AdamW with weight decay 0.1, by the plain DDP Trainer and
    with AdaptiveBatch at the same constant batch (micro-batches of one row, the plain run's per-device
    batches). DDP leaves `unused`, which no rank calls, at `grad=None`, so AdamW neither decays nor moves it;
    `rank0_only` has a gradient on rank 0 alone, which DDP averages with rank 1's zeros. AdaptiveBatch's run
    must be DDP's bit for bit: two ranks add in one order either way, and halving is exact."""
    from helpers import Branches, parameters

    plain_env = {"WORKER_PLAIN": "1"}
    plain, plain_weights = launch(tmp_path, "plain", "branches", micro=1, world_size=2, env=plain_env)
    ours, weights = launch(tmp_path, "adaptive", "branches", micro=1, world_size=2)
    initial = parameters(Branches(rank=0))
    assert len(ours[0]["logs"]) == len(plain[0]["logs"]) == 8
    for run in (plain_weights, weights):
        assert_same_weights(run[0], run[1])  # the ranks agree
        for name in ("unused.weight", "unused.bias"):
            assert torch.equal(run[0][name], initial[name]), name  # no gradient anywhere: left as it was
        for name in ("used.weight", "rank0_only.weight"):
            assert not torch.equal(run[0][name], initial[name]), name  # trained
    assert_same_weights(weights[0], plain_weights[0])  # every parameter DDP's, bit for bit


def test_a_stream_that_ends_early_stops_every_rank_with_the_error(tmp_path):
    # rank 0 reads for both: the error it meets is sent to rank 1, which would otherwise wait for its share
    longer = {"WORKER_ARGS": json.dumps({"max_steps": 20})}  # 80 samples from a stream of 43
    stderr = launch(tmp_path, "short", "stream", micro=1, world_size=2, env=longer, fails=True)
    for rank in (0, 1):
        assert (
            f"[rank{rank}]: adaptive_batch.runtime.stream.StreamEndedError: The training stream ended after 43"
            in stderr
        )


def test_a_stream_read_by_rank_0_resumes_exactly_on_two_ranks(tmp_path):
    saving = {"WORKER_ARGS": json.dumps({"save_strategy": "steps", "save_steps": 4})}
    full, full_weights = launch(tmp_path, "full", "stream", micro=1, world_size=2, env=saving)
    resume = {"WORKER_RESUME": str(tmp_path / "full" / "checkpoint-4")}
    resumed, resumed_weights = launch(tmp_path, "resumed", "stream", micro=1, world_size=2, env=resume)
    # (the checkpoint's log history holds the first 4 steps)
    assert [log["loss"] for log in resumed[0]["logs"]] == [log["loss"] for log in full[0]["logs"]]
    # rank 0 read the skipped steps again, alone
    assert resumed[0]["stream_reads"] == 40 and resumed[1]["stream_reads"] == 0
    assert_same_weights(resumed_weights[0], full_weights[0])


@pytest.mark.parametrize("kind", ["trainer", "sft"])
def test_one_ranks_out_of_memory_makes_every_rank_retry(tmp_path, kind):
    ranks, weights = launch(tmp_path, "oom", kind, micro=2, world_size=2, fake_oom_rank=1)
    assert ranks[1]["raised"] == [2] and ranks[0]["raised"] == []
    assert {log["adaptive_batch/micro_batch_size"] for log in ranks[0]["logs"]} == {1}  # rank 0 shrank too
    assert_same_weights(weights[0], weights[1])
    # the run it should equal: both ranks at 1 from the start, bit for bit (TRL's token count included)
    clean, clean_weights = launch(tmp_path, "clean", kind, micro=1, world_size=2, env=PADDED)
    keys = ("loss", "adaptive_batch/tokens_seen") + (("num_tokens",) if kind == "sft" else ())
    for key in keys:
        assert [log[key] for log in ranks[0]["logs"]] == [log[key] for log in clean[0]["logs"]], key
    assert_same_weights(weights[0], clean_weights[0])


def test_under_fsdp2_one_process_retries_an_out_of_memory_error_exactly(tmp_path):
    # raised in the middle of the backward: the root's and the last layer's gradients were made, some of them
    # reduce-scattered; FSDP's reset_iter_state must undo them (without it the weights differ by 10%)
    retried, weights = launch(
        tmp_path, "oom", "fsdp2", micro=2, world_size=1, fake_oom_rank=0, distributed=True
    )
    assert retried[0]["raised"] == [2]
    assert {log["adaptive_batch/micro_batch_size"] for log in retried[0]["logs"]} == {1}
    clean, clean_weights = launch(
        tmp_path, "clean", "fsdp2", micro=1, world_size=1, distributed=True, env=PADDED
    )
    assert [log["loss"] for log in retried[0]["logs"]] == [log["loss"] for log in clean[0]["logs"]]
    assert_same_weights(weights[0], clean_weights[0])


def test_under_fsdp2_one_ranks_out_of_memory_ends_every_rank_with_the_error(tmp_path):
    # the other rank waits in a collective of the backward: no retry can be made safe, so no hang either
    stderr = launch(tmp_path, "oom", "fsdp2", micro=2, world_size=2, fake_oom_rank=1, fails=True)
    assert "EngineOutOfMemoryError: Out of memory in a micro-batch under FSDP2 with 2 processes" in stderr
    assert "adaptive-batch probe" in stderr


@pytest.mark.parametrize("fake_oom_rank", [None, 1])
def test_ranks_cut_their_own_rows_by_tokens_and_run_as_many_micro_batches(tmp_path, fake_oom_rank):
    single, single_weights = launch(tmp_path, "single", "tokens", micro=40, world_size=1)
    ranks, weights = launch(tmp_path, "ddp", "tokens", micro=40, world_size=2, fake_oom_rank=fake_oom_rank)
    budget = ranks[0]["max_tokens"]
    assert ranks[1]["max_tokens"] == budget
    first = 0  # the first step run at the final budget
    if fake_oom_rank is None:
        assert budget == 40
    else:  # rank 1 ran out above 30 tokens: both ranks halved the budget to half that micro-batch (31 to 40);
        # rank 0 had run larger micro-batches, so the budget of 40 is tried once more, and fails again
        assert len(ranks[1]["raised"]) == 2 and not ranks[0]["raised"] and 15 <= budget <= 20
        first = 1 + max(step for step, rows, length, *_ in ranks[1]["micro_batches"] if rows * length > 30)
    steps = range(first, len(ranks[0]["logs"]))
    counts, cuts = (
        [],
        [],
    )  # per rank and step: micro-batches run, and the rows of those with labels (its own cut)
    for rank in ranks:
        by_step = [[m[1:4] for m in rank["micro_batches"] if m[0] == k] for k in steps]
        assert all(rows == 1 or rows * length <= budget for step in by_step for rows, length, _ in step)
        counts.append([len(step) for step in by_step])
        cuts.append([[rows for rows, _, labels in step if labels] for step in by_step])
    assert counts[0] == counts[1]  # every micro-batch exchanges the OOM flag: as many on every rank
    assert [max(len(a), len(b)) for a, b in zip(*cuts)] == counts[0]
    assert any(a != b for a, b in zip(*cuts))  # the ranks' rows differ in length, and so do their cuts
    assert any(len(a) != len(b) for a, b in zip(*cuts))  # the rank with fewer ran rows that add nothing
    key = "adaptive_batch/tokens_seen"
    assert [log[key] for log in ranks[0]["logs"]] == [log[key] for log in single[0]["logs"]]
    assert_same_weights(weights[0], weights[1])
    assert_close_weights(weights[0], single_weights[0])


def test_auto_by_tokens_makes_the_same_decisions_on_every_rank(tmp_path):
    single, single_weights = launch(tmp_path, "single", "tokens", micro="auto", world_size=1)
    ranks, weights = launch(tmp_path, "ddp", "tokens", micro="auto", world_size=2)
    assert ranks[0]["controller"]["kind"] == "tokens"
    assert not ranks[0]["controller"]["calibrating"] and ranks[0]["controller"]["time_points"]
    # the overhead, the budget and every measurement behind them: the same on both ranks (combined before use)
    assert ranks[0]["controller"] == ranks[1]["controller"]
    assert_same_weights(weights[0], weights[1])
    assert_close_weights(weights[0], single_weights[0])


def test_padding_free_steps_under_ddp_are_cut_by_each_rank_and_survive_one_ranks_oom(tmp_path):
    single, single_weights = launch(tmp_path, "single", "packed", micro=40, world_size=1)
    ranks, weights = launch(tmp_path, "ddp", "packed", micro=40, world_size=2, fake_oom_rank=1)
    assert ranks[1]["raised"] and not ranks[0]["raised"]
    budget = ranks[0]["max_tokens"]
    assert ranks[1]["max_tokens"] == budget < 40  # halved on both ranks
    for rank in ranks:  # one flattened row per micro-batch, within the budget unless one sequence alone
        assert all(rows == 1 for _, rows, *_ in rank["micro_batches"])
    last = [[m for m in rank["micro_batches"] if m[0] == len(rank["logs"]) - 1] for rank in ranks]
    assert len(last[0]) == len(last[1])  # as many micro-batches on every rank
    assert all(length <= budget or sequences == 1 for _, _, length, _, sequences in last[0] + last[1])
    key = "adaptive_batch/tokens_seen"
    assert [log[key] for log in ranks[0]["logs"]] == [log[key] for log in single[0]["logs"]]
    assert_same_weights(weights[0], weights[1])
    assert_close_weights(weights[0], single_weights[0])


def test_the_noise_scale_over_two_ranks_is_that_of_their_micro_batches_together(tmp_path):
    """Linear regression (see helpers.py): 300 steps of 64 fresh rows cut into micro-batches of 8, the last step one
    row short (32 and 31 rows: 8, 8, 8, 8 and 8, 8, 8, 7). Each rank's loss is a mean over its own rows, and the
    ranks' gradients are averaged."""
    from adaptive_batch.core.noise import MicroBatchSums, NoiseScale

    ranks, weights = launch(tmp_path, "noise", "noise", micro=8, world_size=2)
    assert_same_weights(weights[0], weights[1])
    logs = ranks[0]["logs"]
    assert [[log[key] for key in NOISE_KEYS] for log in logs] == [
        [log[key] for key in NOISE_KEYS] for log in ranks[1]["logs"]
    ]
    norm_sq, variance, noise_scale = regression_truth()
    assert logs[-1]["adaptive_batch/noise_scale"] == pytest.approx(noise_scale, rel=0.10)
    assert logs[-1]["adaptive_batch/grad_norm_sq"] == pytest.approx(norm_sq, rel=0.10)
    assert logs[-1]["adaptive_batch/grad_variance"] == pytest.approx(variance, rel=0.10)
    assert 0 < ranks[0]["lower_bound"] < logs[-1]["adaptive_batch/noise_scale"]

    # the micro-batches' gradients, read by the test's own hook on each rank: halved (the ranks' average), they add
    # up to the step's gradient; the logged estimates are the estimator's on them, with the shares n_j / (2 x the
    # rank's rows), which differ from n_j / 63 in the last step
    expected = NoiseScale(1e9)
    steps = zip(ranks[0]["parts"], ranks[1]["parts"], ranks[0]["step_gradients"], logs, strict=True)
    for parts_0, parts_1, gradient, log in steps:
        rows = [[n for n, _ in parts_0], [n for n, _ in parts_1]]
        assert rows == [[8, 8, 8, 8], [8, 8, 8, 8 if log["step"] < 300 else 7]]
        gradient = torch.tensor(gradient, dtype=torch.float64)
        contributions = [torch.tensor(d, dtype=torch.float64) / 2 for _, d in parts_0 + parts_1]
        assert torch.allclose(sum(contributions), gradient, rtol=1e-13, atol=0)
        sums = MicroBatchSums()
        for parts, own in zip((parts_0, parts_1), rows):
            for n, d in parts:
                contribution = torch.tensor(d, dtype=torch.float64) / 2
                sums.add(n, n / (2 * sum(own)), float(contribution @ contribution))
        samples = sum(rows[0]) + sum(rows[1])
        expected.update(sums.estimate(float(gradient @ gradient), samples=samples), samples=samples)
        assert log["adaptive_batch/grad_norm_sq"] == pytest.approx(expected.grad_norm_sq, rel=1e-10)
        assert log["adaptive_batch/grad_variance"] == pytest.approx(expected.grad_variance, rel=1e-10)
    assert expected.steps == len(logs) == 300


def test_a_noise_scale_schedule_makes_the_same_changes_on_every_rank(tmp_path):
    """The ranks time their steps apart and here model them differently (see `growing_run`): the largest proposal
    holds for both, from the same step; both train every row once between them and end with the same weights."""
    ranks, weights = launch(tmp_path, "growing", "growing", micro=16, world_size=2)
    assert_same_weights(weights[0], weights[1])
    changes = ranks[0]["changes"]
    assert [c[1] for c in changes][:2] == [64, 128]
    # (step, size, samples seen, noise scale): the same on both ranks, so the gain rule's LR is too
    assert [c[:3] + c[4:] for c in changes] == [c[:3] + c[4:] for c in ranks[1]["changes"]]
    assert changes[0][4] is not None and changes[0][4] > 0
    rates = [[log["learning_rate"] for log in rank["logs"]] for rank in ranks]
    assert rates[0] == rates[1] and max(rates[0]) > min(rates[0])
    assert changes[0][3].startswith("goodput x") and ranks[1]["changes"][0][3] == "another rank's step times"
    assert ranks[0]["plan"] == ranks[1]["plan"]
    assert ranks[0]["global_step"] == ranks[0]["max_steps"] == len(ranks[0]["plan"])
    assert sorted(ranks[0]["seen"] + ranks[1]["seen"]) == sorted(ranks[0]["dataset"])
    sizes = [log["adaptive_batch/effective_batch_size"] for log in ranks[0]["logs"]]
    assert sizes == ranks[0]["plan"]


def test_one_ranks_out_of_memory_in_evaluation_makes_every_rank_run_the_batch_in_pieces(tmp_path):
    # rank 1 runs out of memory above one row: both ranks run each eval batch of 4 again in pieces of 1 (they agree
    # after every piece, and before every collective of the Trainer inside one), and the metrics are the clean run's
    import numpy as np

    clean, _ = launch(tmp_path, "clean", "eval", micro=4, world_size=2)
    ranks, _ = launch(tmp_path, "oom", "eval", micro=4, world_size=2, fake_oom_rank=1)
    assert ranks[1]["raised"] == [4, 2] and ranks[0]["raised"] == []
    for rank in ranks:
        assert rank["metrics"]["eval_adaptive_batch/micro_batch_size"] == 1
    metrics, expected = ranks[0]["metrics"], clean[0]["metrics"]
    assert metrics["eval_rows"] == expected["eval_rows"] == 22
    assert metrics["eval_loss"] == pytest.approx(expected["eval_loss"], rel=1e-12)
    for name in ("predictions0.npy", "labels0.npy"):
        got, want = np.load(tmp_path / "oom" / name), np.load(tmp_path / "clean" / name)
        assert got.shape == want.shape
        np.testing.assert_allclose(got, want, rtol=1e-12, atol=1e-12)


def test_a_growing_eval_batch_is_the_same_on_every_rank(tmp_path):
    # rank 0's evaluations get faster as the batch doubles, rank 1's do not: both go by the slowest rank, so both
    # try 8 after 4, see that it did not pay, and keep 4 (each alone would run different eval batches and hang)
    ranks, _ = launch(tmp_path, "grow", "eval", micro=4, world_size=2, env={"WORKER_GROW": "4,2,2;4,4,4"})
    for rank in ranks:
        sizes = [m["eval_adaptive_batch/micro_batch_size"] for m in rank["evaluations"]]
        assert sizes == [4, 8, 4]
    losses = [[m["eval_loss"] for m in rank["evaluations"]] for rank in ranks]
    assert losses[0] == losses[1]
    # each evaluation is the plain run's at its eval batch (the clean runs at 4 and 8)
    for size, loss in zip([4, 8], losses[0]):
        clean, _ = launch(tmp_path, f"clean{size}", "eval", micro=size, world_size=2)
        assert loss == pytest.approx(clean[0]["metrics"]["eval_loss"], rel=1e-12)
    assert ranks[0]["evaluations"][0]["eval_rows"] == 22


def test_ranks_that_cut_ragged_eval_batches_differently_run_as_many_pieces(tmp_path):
    # loss-only evaluation of ragged rows under "grow": rank 0 knows a forward's fixed time and cuts its batches by
    # tokens, rank 1 does not yet and would run them whole; it splits them so that both run as many forwards
    ragged = {"WORKER_RAGGED": "1"}
    clean, _ = launch(tmp_path, "clean", "eval", micro=8, world_size=2, env=ragged)
    env = {**ragged, "WORKER_GROW": "1;1", "WORKER_OVERHEAD_RANK0": "4"}
    ranks, _ = launch(tmp_path, "cut", "eval", micro=8, world_size=2, env=env)
    assert ranks[0]["metrics"]["eval_adaptive_batch/batches_cut_by_tokens"] >= 1
    assert ranks[1]["metrics"]["eval_adaptive_batch/batches_cut_by_tokens"] >= 1  # (split to rank 0's count)
    for rank in ranks:
        assert rank["metrics"]["eval_loss"] == pytest.approx(clean[0]["metrics"]["eval_loss"], rel=1e-12)


def test_eval_batches_of_different_rows_on_the_ranks_end_with_one_clear_error_not_a_hang(tmp_path):
    # without even batches the ranks' eval batches differ in rows (21 rows on two ranks): once an error made them
    # run in pieces, they cannot run the same pieces there, and every rank stops with the error instead of waiting
    uneven = {"WORKER_UNEVEN": "1"}
    stderr = launch(
        tmp_path, "uneven", "eval", micro=6, world_size=2, fake_oom_rank=1, fails=True, env=uneven
    )
    errors = [line for line in stderr.splitlines() if "RuntimeError: The eval batches hold" in line]
    assert len(errors) == 2  # both ranks
    assert re.search(r"hold \d+ to \d+ rows on different ranks", errors[0])
    assert "even_batches=True" in errors[0]
