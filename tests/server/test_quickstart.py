"""The README's quickstart works as written against the embedded model on CPU: its curl
request and its exact Python snippet (plain answer, structured output, tool call), run
against a server started as `make run` starts it."""

from __future__ import annotations

import contextlib
import io
import json
import re
import shlex

import httpx
import pytest
from server_harness import ROOT, ServerThread

README = (ROOT / "README.md").read_text()
QUICKSTART_URL = "http://127.0.0.1:8000"


def quickstart_snippet() -> str:
    marker = README.index("<!-- quickstart.py:")
    block = re.search(r"```python\n(.*?)```", README[marker:], re.S)
    assert block, "no python block after the quickstart marker"
    return block.group(1)


def quickstart_curl() -> list[str]:
    section = README[README.index("## Quickstart"):README.index("<!-- quickstart.py:")]
    line = re.search(r"^curl .*?(?<!\\)$", section.replace("\\\n", " "), re.M)
    assert line, "no curl command in the quickstart"
    return shlex.split(line.group(0))


@pytest.fixture(scope="module")
def server(smol_model):
    # As `make run`: the embedded model, hermes tool calls with tool_choice "auto".
    srv = ServerThread(
        smol_model, served_model_names=["SmolLM2-135M-Instruct"], max_model_len=1024,
        app_kwargs={"tool_call_parser": "hermes", "enable_auto_tool_choice": True},
    ).start()
    yield srv
    srv.stop()


def test_the_quickstart_curl_answers(server) -> None:
    argv = quickstart_curl()
    url = argv[next(i for i, a in enumerate(argv) if a.startswith("http"))]
    body = json.loads(argv[argv.index("-d") + 1])
    response = httpx.post(url.replace(QUICKSTART_URL, server.base_url), json=body, timeout=120)
    assert response.status_code == 200, response.text
    assert response.json()["choices"][0]["message"]["content"].strip()  # sampled: any text


def test_the_quickstart_python_snippet_runs(server) -> None:
    code = quickstart_snippet()
    assert QUICKSTART_URL + "/v1" in code
    output = io.StringIO()
    with contextlib.redirect_stdout(output):
        exec(compile(code.replace(QUICKSTART_URL, server.base_url), "quickstart.py", "exec"), {})
    plain, place, call = output.getvalue().strip().split("\n")[-3:]
    assert "Paris" in plain
    assert {"city", "country"} <= set(eval(place))  # printed as a dict
    assert call.startswith("get_weather {'city': ")
