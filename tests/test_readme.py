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


def test_the_layout_table_names_every_module():
    """README's layout table and docs/architecture.md name every module of the package, in its folder."""
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read().split("## Layout", 1)[1].split("\n## ", 1)[0]
    with open(os.path.join(ROOT, "docs", "architecture.md")) as f:
        architecture = f.read()
    folder, named = "", set()
    for row in re.findall(r"^\|(.*?)\|(.*?)\|", readme, re.M):
        folder = row[0].strip(" `") or folder
        named |= {f"{folder}{m}" for m in re.findall(r"`([\w/]+(?:\.py)?)`", row[1])}
    package = os.path.join(ROOT, "elastic_oneshot")
    modules = {os.path.relpath(os.path.join(d, f), package) for d, _, files in os.walk(package)
               for f in files if f.endswith(".py") and f != "__init__.py" and "testing" not in d
               and "families" not in d and d != package}
    assert not modules - named, sorted(modules - named)
    assert not [m for m in modules if os.path.basename(m) not in architecture]
