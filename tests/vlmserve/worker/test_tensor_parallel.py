"""Tensor parallelism end to end on CPU (gloo): two ranks, two processes, the same greedy
tokens as one, images included, for GQA, MHA and a model with fewer KV heads than ranks
(KV heads replicated); the workers end with the engine, however it ends.

Each case starts one TP engine (process start is the cost) and runs all its requests in
it; the one-rank reference runs the same requests in this process."""

from __future__ import annotations

import gc

import pytest

from encoders.config import EncoderConfig
from vlmserve.cli.main import main
from vlmserve.config import EngineConfig, ModelConfig, ParallelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.worker.models.random_checkpoint import make_vlm_checkpoint


def engine(path, tp: int, **scheduler) -> Engine:
    from scheduler.config import SchedulerConfig

    return Engine(
        EngineConfig(
            ModelConfig(str(path)),
            scheduler=SchedulerConfig(**scheduler),
            encoder=EncoderConfig(num_workers=0),
            parallel=ParallelConfig(tp),
        )
    )


def requests(random_image) -> list[Request]:
    greedy = SamplingParams(max_tokens=8, temperature=0.0)

    def ask(content, text):
        return Request(messages=[{"role": "user", "content": content + [
            {"type": "text", "text": text}]}], sampling=greedy)  # fmt: skip

    return [
        ask([{"type": "image", "image": random_image(1, 70, 50)}], "what is this?"),
        ask([], "a text-only question"),
        ask([{"type": "image", "image": random_image(2, 40, 90)}], "and this one?"),
    ]


def tokens(outputs) -> list[list[int]]:
    assert all(out.error is None for out in outputs), [out.error for out in outputs]
    return [out.token_ids for out in outputs]


@pytest.fixture(scope="module")
def mqa_path(tmp_path_factory):
    """Idefics3 with 4 query heads over ONE KV head: at TP 2 both ranks hold it."""
    return make_vlm_checkpoint(tmp_path_factory.mktemp("mqa"), "idefics3", kv_heads=1)


@pytest.mark.slow
def test_gqa_two_ranks_equal_one_and_close_ends_the_workers(llava_ov_path, random_image):
    reference = tokens(engine(llava_ov_path, 1).generate(requests(random_image)))
    # Async scheduling: the engine thread encodes while the forward thread steps.
    tp = engine(llava_ov_path, 2, async_scheduling=True)
    runner = tp.runner
    processes = runner._channel.processes
    try:
        # 4 query heads over 2 KV heads: each rank caches its one KV head.
        assert runner.kv_caches[0].shape[1] == 1
        assert runner.model.decoder.layers[0].self_attn.qkv_proj.out_features == (2 + 2) * 16
        assert tokens(tp.generate(requests(random_image))) == reference
        assert runner.encoder_stage.num_tower_calls >= 1  # the tower ran, spread over ranks
    finally:
        tp.close()
    assert [p.exitcode for p in processes] == [0]  # stopped by its message, not killed


@pytest.mark.slow
def test_mha_two_ranks_equal_one_and_gc_ends_the_workers(idefics3_path, random_image):
    reference = tokens(engine(idefics3_path, 1).generate(requests(random_image)))
    tp = engine(idefics3_path, 2)
    processes = tp.runner._channel.processes
    assert tp.runner.kv_caches[0].shape[1] == 2  # 4 KV heads over 2 ranks
    assert tokens(tp.generate(requests(random_image))) == reference
    del tp
    gc.collect()
    assert [p.exitcode for p in processes] == [0]


@pytest.mark.slow
def test_more_ranks_than_kv_heads_replicates_them_through_generate(
    mqa_path, random_image, tmp_path, capsys
):
    """The `generate` door with --tensor-parallel-size 2 on a one-KV-head model."""
    image = tmp_path / "image.png"
    random_image(3, 60, 60).save(image)
    argv = ["generate", "--model", str(mqa_path), "--image", str(image), "--prompt", "what?",
            "--max-tokens", "8", "--temperature", "0", "--preprocess-workers", "0"]  # fmt: skip
    assert main(argv) == 0
    one = capsys.readouterr()
    assert main([*argv, "--tensor-parallel-size", "2"]) == 0
    two = capsys.readouterr()
    assert two.out == one.out and one.out.strip()
    # The same prompt and output token counts ("[N prompt tokens (K image), M output").
    assert two.err.split(" output")[0] == one.err.split(" output")[0]


@pytest.mark.slow
def test_replicated_kv_heads_are_token_exact(mqa_path, random_image):
    reference = tokens(engine(mqa_path, 1).generate(requests(random_image)))
    tp = engine(mqa_path, 2)
    try:
        assert tp.runner.kv_caches[0].shape[1] == 1  # each rank a full copy of the KV head
        assert tokens(tp.generate(requests(random_image))) == reference
    finally:
        tp.close()


def test_a_size_that_does_not_split_the_model_fails_before_any_start(llava_ov_path):
    with pytest.raises(ValueError, match="--tensor-parallel-size: .*does not divide the 4"):
        engine(llava_ov_path, 3)
