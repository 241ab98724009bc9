"""The README's worker request fields, run as the README shows them: `return_scores` is an int k (top-k), and
`true`, which a reader might send from its name, is refused with a message that says so."""

from __future__ import annotations

import json
import os
import pathlib
import re
import subprocess
import sys

REPO = pathlib.Path(__file__).resolve().parent.parent


def test_the_readmes_return_scores_example_gives_k_scores_and_a_bool_is_refused() -> None:
    readme = (REPO / "README.md").read_text()
    assert "`return_scores`\n(int k, 0 to 1000" in readme or "`return_scores` (int k" in readme.replace("\n", " ")
    example = re.search(r"echo '(\{[^']*\"return_scores\": 5\})' \| \.venv/bin/tiercache worker --no-cache", readme)
    assert example, "the README's return_scores example is gone"
    lines = [example.group(1), json.dumps({"prompt": "The kitchen lights are", "return_scores": True})]
    done = subprocess.run([sys.executable, "-m", "tiercache.cli", "worker", "--no-cache"],
                          input="\n".join(lines) + "\n",
                          cwd=REPO, capture_output=True, text=True, check=False, timeout=180,
                          env={**os.environ, "PYTHONPATH": str(REPO)})
    results = [json.loads(line) for line in done.stdout.splitlines()]
    assert len(results) == 2, done.stdout + done.stderr
    scores = results[0]["scores"]
    assert len(scores) == 5 and all(isinstance(t, int) for t, _ in scores)
    assert [s for _, s in scores] == sorted((s for _, s in scores), reverse=True)
    assert results[1] == {"error": 'InvalidArgument: "return_scores" must be an int in [0, 1000], got True'}
