"""The engine thread under faults: a dying engine answers everything in flight at once and
turns /health to 503; stop and abort reach requests still being prepared; request fields
the engine does not implement are refused by name."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

pytest.importorskip("fastapi")  # the server's libraries: skip where they are missing
pytest.importorskip("uvicorn")
pytest.importorskip("openai")  # test_server drives the server with it

from server_testing import KEY, engine_config, png, serve, user

from vlmserve.engine.core import Engine
from vlmserve.inputs.processing import Request
from vlmserve.sample.params import SamplingParams
from vlmserve.server.engine_loop import EngineLoop, Failed, RequestAborted

LONG = {"max_tokens": 400, "temperature": 0, "ignore_eos": True}


class DyingEngine(Engine):
    """Raises out of `step` (a bookkeeping bug, not a request's fault) once told to."""

    die = threading.Event()

    def step(self):
        if self.die.is_set():
            raise SystemError("scheduler invariant broken")
        return super().step()


class SlowPrepareEngine(Engine):
    """`prepare` waits for a gate, so a test can act while a request is being prepared."""

    entered = threading.Event()
    gate = threading.Event()

    def prepare(self, request):
        self.entered.set()
        assert self.gate.wait(30)
        return super().prepare(request)


def chat(text: str, **extra) -> dict:
    return {"messages": [{"role": "user", "content": text}], **extra}


@pytest.mark.slow
def test_a_dead_engine_fails_what_is_in_flight_at_once_and_health_turns_503(llava_ov_path):
    deaths: list[BaseException] = []
    DyingEngine.die.clear()
    factory = lambda: DyingEngine(engine_config(llava_ov_path))
    with serve(factory, on_engine_death=deaths.append) as served:
        answers: list[tuple[float, httpx.Response]] = []

        def ask() -> None:
            response = served.post(chat("one two three", **LONG), key=None)
            answers.append((time.monotonic(), response))

        thread = threading.Thread(target=ask)
        thread.start()
        loop = served.app.state.engine_loop
        assert _wait(lambda: loop.engine is not None and loop.engine.has_unfinished())
        died_at = time.monotonic()
        DyingEngine.die.set()
        thread.join(10)
        [(answered_at, response)] = answers
        assert response.status_code == 500 and answered_at - died_at < 1.5
        assert "died" in response.json()["error"]["message"]
        health = httpx.get(served.url("/health"))
        assert (health.status_code, health.json()["status"]) == (503, "failed")
        assert "invariant" not in health.text  # the cause is logged, not published
        assert served.post(chat("hi", max_tokens=2), key=None).status_code == 503
    assert len(deaths) == 1 and isinstance(deaths[0], SystemError)
    DyingEngine.die.clear()


def test_an_engine_that_fails_to_load_calls_on_death(llama_path):
    deaths: list[BaseException] = []

    def broken() -> Engine:
        raise FileNotFoundError("/secret/path/config.json")

    with serve(broken, wait_ready=False, on_engine_death=deaths.append) as served:
        assert _wait(lambda: deaths)
        health = httpx.get(served.url("/health"))
        assert health.status_code == 503 and "/secret" not in health.text


@pytest.fixture(scope="module")
def slow_loop(llama_path):
    loop = EngineLoop(lambda: SlowPrepareEngine(engine_config(llama_path, num_blocks=64)))
    loop.start()
    assert _wait(lambda: loop.state == "ready")
    return loop


def _submit(loop: EngineLoop, request_id: str) -> list:
    items: list = []
    SlowPrepareEngine.entered.clear()
    params = SamplingParams(max_tokens=2, temperature=0.0)
    loop.submit(Request(prompt="one two", sampling=params, request_id=request_id), items.append)
    assert SlowPrepareEngine.entered.wait(10)
    return items


def test_an_abort_during_preparation_drops_the_request(slow_loop):
    SlowPrepareEngine.gate.clear()
    items = _submit(slow_loop, "early")
    slow_loop.abort("early")
    SlowPrepareEngine.gate.set()
    assert _wait(lambda: items)
    time.sleep(0.2)
    [item] = items
    assert isinstance(item, Failed) and isinstance(item.error, RequestAborted)
    assert slow_loop.num_pending == 0 and not slow_loop.engine.has_unfinished()


def test_stop_answers_a_request_still_being_prepared_at_once(slow_loop):
    SlowPrepareEngine.gate.clear()
    items = _submit(slow_loop, "late")
    slow_loop.stop(timeout=10)
    [item] = items  # answered before its preparation ended
    assert isinstance(item, Failed) and getattr(item.error, "status", None) == 503
    SlowPrepareEngine.gate.set()
    time.sleep(0.3)
    assert len(items) == 1 and slow_loop.num_pending == 0


@pytest.mark.slow
def test_fields_the_engine_does_not_implement_are_refused_by_name(llava_ov_path):
    with serve(lambda: Engine(engine_config(llava_ov_path)), api_key=KEY) as served:
        for extra, name in [
            ({"best_of": 2}, "best_of"),
            ({"prediction": {"type": "content", "content": "x"}}, "prediction"),
        ]:
            response = served.post(chat("hi", max_tokens=2, **extra))
            assert response.status_code == 400 and name in response.json()["error"]["message"]
        # Their "not used" values are fine, as are fields that change nothing.
        fine = chat("hi", max_tokens=2, tools=[], logit_bias={}, presence_penalty=0, store=False)
        assert served.post(fine).status_code == 200
        tiny = chat("one two", max_tokens=4, temperature=1e-40, top_p=1e-300, ignore_eos=True)
        greedy = chat("one two", max_tokens=4, temperature=0, ignore_eos=True)
        answers = [served.post(b).json()["choices"][0]["message"] for b in (tiny, greedy)]
        assert answers[0]["content"] == answers[1]["content"]


def _wait(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.02)
    return False


def test_a_retryable_failure_inside_a_step_stays_a_503():
    from vlmserve.engine.core import RequestOutput
    from vlmserve.server.chat import error_response, public_message
    from vlmserve.server.engine_loop import failure_of

    message = "preprocessing worker died on each of 2 attempts; retry later"
    out = RequestOutput("r", finished=True, finish_reason="error", error_status=503, error=message)
    response = error_response(failure_of(out))
    assert response.status_code == 503 and response.headers["Retry-After"] == "1"
    out.error_status = 500
    assert error_response(failure_of(out)).status_code == 500
    # Our messages keep a host spelled in hex; an object address is redacted.
    assert "0x7f000001" in public_message(ValueError("cannot fetch https://0x7f000001/"))
    assert "0x7f3a5c2e1b90" not in public_message(ValueError("<obj at 0x7f3a5c2e1b90>"))


class CountingEngine(Engine):
    """Counts `prepare` calls (template, tokenisation, image decode)."""

    prepared: list[str] = []

    def prepare(self, request):
        self.prepared.append(request.request_id)
        return super().prepare(request)


@pytest.mark.slow
def test_n_choices_share_one_preparation_of_their_prompt(llava_ov_path, random_image):
    CountingEngine.prepared.clear()
    factory = lambda: CountingEngine(engine_config(llava_ov_path))
    with serve(factory) as served:
        body = {
            "messages": [user("what is this?", png(random_image, 3))],
            "n": 3, "max_tokens": 4, "temperature": 1.0, "seed": 7,
        }  # fmt: skip
        response = served.post(body)
        assert response.status_code == 200, response.text
        choices = response.json()["choices"]
        assert sorted(c["index"] for c in choices) == [0, 1, 2]
        assert len(CountingEngine.prepared) == 1  # one template, one image decode
