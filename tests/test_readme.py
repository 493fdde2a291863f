"""The README's two commands are the ones CI runs (.ci/run holds them), so neither can break unnoticed."""

import os
import re
import subprocess

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def ci_commands() -> list[str]:
    """FIRST_COMMAND and TEST_COMMAND as bash reads them from .ci/run (without running it)."""
    script = ('eval "$(grep -E "^(FIRST|TEST)_COMMAND=" .ci/run)"; '
              'printf "%s\\n%s\\n" "$FIRST_COMMAND" "$TEST_COMMAND"')
    out = subprocess.run(["bash", "-c", script], cwd=ROOT, capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def readme_commands() -> list[str]:
    with open(os.path.join(ROOT, "README.md")) as f:
        block = re.search(r"```bash\n(.*?)```", f.read(), re.S).group(1)
    return block.splitlines()


def test_ci_runs_the_readme_commands_as_written():
    first, test = ci_commands()
    assert first and test
    assert readme_commands() == [first, test]


def test_the_first_commands_output_is_ignored_by_git():
    paths = ["SmolLM2-135M-Instruct-W4A16/model.safetensors", "SmolLM2-135M-Instruct-W4A16.state/job.json"]
    proc = subprocess.run(["git", "check-ignore", "--no-index", *paths], cwd=ROOT, capture_output=True, text=True)
    assert proc.stdout.splitlines() == paths
