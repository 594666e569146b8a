"""benchmarks/lib/engine_calibration.py: the steps it records from a real engine carry
the counts the simulator prices, the sliding layers' windowed ones for Gemma 3."""

from __future__ import annotations

from benchmarks.lib.engine_calibration import StepRecorder
from scheduler.config import CacheConfig, SchedulerConfig
from vlmserve.config import EngineConfig, ModelConfig
from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams


def recorded_steps(path) -> list:
    config = EngineConfig(
        ModelConfig(str(path)),
        CacheConfig(num_blocks=256, block_size=4),
        SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4),
    )
    recorder = StepRecorder(Engine(config))
    text = " ".join(["count the stars on the left and then the right"] * 10)
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)
    recorder.engine.add_request(
        Request(messages=[{"role": "user", "content": text}], sampling=params)
    )
    while recorder.engine.has_unfinished():
        recorder.engine.step()
    return [work for work, _, _ in recorder.samples(cycle=False)]


def test_gemma3_steps_count_the_sliding_window(gemma3_path):
    """Window 64, chunks of 48 rows: a prompt past the window is prefilled in chunks that
    reach and cross it, then decoded past it; every step's windowed counts are its own
    (one sequence: each row priced at min(context, 64) keys)."""
    works = recorded_steps(gemma3_path)
    assert works[-1].num_decode_rows == 1 and works[-1].num_kv_tokens_read > 64
    assert any(w.num_prefill_tokens and w.num_kv_tokens_read > 64 for w in works)
    for w in works:
        context, rows = w.num_kv_tokens_read, w.num_dense_rows
        assert w.num_kv_tokens_read_in_window == min(context, 64)
        assert w.num_attention_pairs == rows * context
        assert w.num_attention_pairs_in_window == rows * min(context, 64)


def test_a_model_without_sliding_layers_counts_no_window(llava_ov_path):
    works = recorded_steps(llava_ov_path)
    assert works and all(w.num_kv_tokens_read_in_window is None for w in works)
