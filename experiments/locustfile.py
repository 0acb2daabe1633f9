"""Locust users for `experiments.soak`: each streams greedy chat completions of prompts from a pool and
checks every answer against the answer the same server gave that prompt alone (greedy answers do not
depend on what else is batched, so any other text is a session mix-up or a corruption, and fails).

Run by `python -m experiments.soak` in a process of its own (locust patches the standard library with
gevent); MOASPEC_SOAK_EXPECTED names a JSON file {"model": ..., "max_tokens": ..., "answers": {prompt:
text}}, MOASPEC_API_KEY the key, if any.
"""

from __future__ import annotations

import json
import os
import random
import time

from locust import HttpUser, between, task

EXPECTED = json.loads(open(os.environ["MOASPEC_SOAK_EXPECTED"]).read())  # noqa: SIM115 - read once per process
KEY = os.environ.get("MOASPEC_API_KEY", "")


class ChatUser(HttpUser):
    wait_time = between(0.0, 0.5)

    @task
    def chat(self) -> None:
        prompt = random.choice(list(EXPECTED["answers"]))
        body = {"model": EXPECTED["model"], "messages": [{"role": "user", "content": prompt}], "temperature": 0,
                "max_tokens": EXPECTED["max_tokens"], "stream": True}
        headers = {"Authorization": f"Bearer {KEY}"} if KEY else {}
        t0 = time.perf_counter()
        first = None
        parts: list[str] = []
        with self.client.post("/v1/chat/completions", json=body, headers=headers, stream=True, catch_response=True,
                              name="chat (stream)", timeout=600) as r:
            if r.status_code != 200:
                r.failure(f"status {r.status_code}: {r.text[:200]}")
                return
            for line in r.iter_lines():
                if not line.startswith(b"data: {"):
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    r.failure(f"error in stream: {chunk['error']}")
                    return
                delta = chunk["choices"][0]["delta"].get("content") if chunk["choices"] else None
                if delta:
                    first = first or time.perf_counter()
                    parts.append(delta)
            text = "".join(parts)
            if text != EXPECTED["answers"][prompt]:
                r.failure(f"answer differs from the lone answer: {text[:80]!r}")
                return
            r.success()
        done = time.perf_counter()
        # locust times a streamed request to its headers: the first token and the whole answer as entries of their own
        for name, at in (("first token", first), ("whole answer", done)):
            if at is not None:
                self.environment.events.request.fire(request_type="SSE", name=name, response_time=(at - t0) * 1e3,
                                                     response_length=0, exception=None, context={})
