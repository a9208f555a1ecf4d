#!/usr/bin/env python3
"""`make docs-check`: type every command of the README and the quick start as a user would, and stop at the first
one that fails.

Each file is typed in a fresh clone of the repository's committed HEAD (so uncommitted changes are not checked;
``--source DIR`` checks a copy of a working tree instead), with a shell of its own that no virtual environment is
active in: the venv is the one the document creates. Every ```bash block of the file runs in order, one command at a
time, each in the clone's root; what a command exports or sources (``source .venv/bin/activate``) carries over to the
next command, as in a terminal (variables it sets without exporting them do not). Lines continued with ``\\`` are one
command, and so are the lines of a compound command (``for ... done``); ``# comments`` are dropped. pip runs with
PIP_REQUIRE_VIRTUALENV, so that a document that installs before it activates a venv fails instead of installing into
the machine's Python. A command that runs past ``--timeout`` (15 minutes) is ended with whatever it started, and
fails. Only ```bash blocks are typed; a block of another language that reads like shell commands, or a fence with no
language (or sh, shell, console), is an error: it would hide commands from this check.

A comment right before a block (only blank lines between) changes how it is typed:

    <!-- docs-check: skip: REASON -->
        the block is not typed (placeholders such as lighthouse-host, a command CI runs by itself); every skip is
        printed with its reason.
    <!-- docs-check: instead of the block above -->
        the block is an alternative to the bash block above it: it is typed in a new clone and a new shell, after
        every command of the file before that block (for example a wheel instead of ``pip install .``).

Standard library only: it runs with the machine's python3, before any environment exists.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT_FILES = ("README.md", "docs/quickstart.md")
SHELL_TAGS = {"", "sh", "shell", "console", "zsh", "shell-session", "sh-session", "terminal"}
# The first word of a line that makes a block of another language read like shell commands.
COMMAND_WORDS = {"pip", "pip3", "python", "python3", "make", "source", "export", "lightning-ft", "torchrun", "git"}
MARKER = re.compile(r"^\s*<!--\s*docs-check:\s*(.*?)\s*-->\s*$")
FENCE = re.compile(r"^(\s*)(`{3,}|~{3,})\s*([\w+-]*)\s*$")
TAIL_LINES = 40
# Variables of the checker's own environment that would make a command run elsewhere than a user's fresh shell.
DROPPED_VARIABLES = ("VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "CONDA_PREFIX", "MAKEFLAGS", "MAKELEVEL", "MFLAGS")
SHELL_OWN_VARIABLES = ("_", "PWD", "OLDPWD", "SHLVL")


class DocsError(Exception):
    """A Markdown file that cannot be typed as it is (a bad marker, an untagged command block)."""


@dataclass
class Command:
    line: int  # 1-based line of the command's first line in its file
    text: str  # as bash runs it, comments dropped


@dataclass
class Block:
    file: str
    line: int  # the opening fence's line
    language: str
    commands: list[Command] = field(default_factory=list)
    skip: str | None = None  # the reason, when the block is not typed
    instead: bool = False


def split_commands(body: list[str], first_line: int) -> list[Command]:
    """The commands of a bash block: one per logical line (``\\``-newline continues it, a newline inside quotes too),
    with comments dropped."""
    text = "\n".join(body) + "\n"
    commands: list[Command] = []
    current: list[str] = []
    start: int | None = None
    line = first_line
    quote: str | None = None
    comment = False
    i = 0
    while i < len(text):
        char, following = text[i], text[i + 1 : i + 2]
        i += 1
        if comment and char != "\n":
            continue
        comment = False
        if char == "\n":
            line += 1
            if quote is not None:
                current.append(char)
            else:
                if start is not None:  # (a comment after a continued line ends the command there)
                    commands.append(Command(start, re.sub(r"\\\n\s*$", "", "".join(current)).strip()))
                current, start = [], None
            continue
        if start is None and not char.isspace():
            start = line
        if quote == "'":
            quote = None if char == "'" else quote
        elif char == "\\" and following:  # an escaped character, or a line continued
            char += following
            line += following == "\n"
            i += 1
        elif quote == '"':
            quote = None if char == '"' else quote
        elif char in "'\"":
            quote = char
        elif char == "#" and (not current or current[-1][-1].isspace()):
            comment = True
            start = start if "".join(current).strip() else None
            continue
        current.append(char)
    if quote is not None:
        raise DocsError(f"line {start}: an unterminated {quote} quote")
    # A compound command over several lines (if, for, a function) is one command: join lines until bash can parse it.
    joined: list[Command] = []
    for command in commands:
        if joined and not parses(joined[-1].text):
            joined[-1].text += "\n" + command.text
        else:
            joined.append(command)
    if joined and not parses(joined[-1].text):
        raise DocsError(f"line {joined[-1].line}: bash cannot parse {joined[-1].text!r}")
    return joined


def parses(command: str) -> bool:
    return subprocess.run(["bash", "-n", "-c", command], capture_output=True).returncode == 0


def parse(file: str, text: str) -> list[Block]:
    """Every fenced block of a Markdown file, with the commands of its bash blocks and the markers before them."""
    lines = text.splitlines()
    blocks: list[Block] = []
    pending: tuple[int, str] | None = None  # a marker waiting for its block: (line, text)
    i = 0
    while i < len(lines):
        number = i + 1
        marker = MARKER.match(lines[i])
        fence = FENCE.match(lines[i])
        if marker:
            if pending is not None:
                raise DocsError(f"{file}:{pending[0]}: a docs-check marker with no block after it")
            pending = (number, marker.group(1))
        elif fence:
            indent, ticks, language = fence.groups()
            end = i + 1
            while end < len(lines) and not (
                lines[end].strip().startswith(ticks) and lines[end].strip().strip(ticks[0]) == ""
            ):
                end += 1
            if end == len(lines):
                raise DocsError(f"{file}:{number}: a fenced block that is never closed")
            body = [line[len(indent) :] if line.startswith(indent) else line.lstrip() for line in lines[i + 1 : end]]
            block = Block(file, number, language.lower())
            if block.language == "bash":
                try:
                    block.commands = split_commands(body, number + 1)
                except DocsError as error:
                    raise DocsError(f"{file}: {error}") from None
            elif block.language in SHELL_TAGS:
                raise DocsError(
                    f"{file}:{number}: a ```{language} block: tag commands ```bash (typed by this check) and "
                    "anything else with its language"
                )
            else:
                for offset, line in enumerate(body):
                    words = line.split()
                    if words and words[0] in COMMAND_WORDS and (len(words) > 1 or words[0] == "make"):
                        raise DocsError(
                            f"{file}:{number + 1 + offset}: a ```{language} block that reads like a shell command "
                            f"({line.strip()!r}): commands go in ```bash blocks, which this check types"
                        )
            if pending is not None:
                apply_marker(block, *pending)
                pending = None
            blocks.append(block)
            i = end
        elif pending is not None and lines[i].strip():
            raise DocsError(f"{file}:{pending[0]}: a docs-check marker must come right before its block")
        i += 1
    if pending is not None:
        raise DocsError(f"{file}:{pending[0]}: a docs-check marker with no block after it")
    return blocks


def apply_marker(block: Block, line: int, text: str) -> None:
    where = f"{block.file}:{line}"
    if block.language != "bash":
        raise DocsError(f"{where}: a docs-check marker before a ```{block.language} block (only bash blocks are typed)")
    skip = re.fullmatch(r"skip:\s*(.*)", text)
    if skip:
        if not skip.group(1):
            raise DocsError(f"{where}: a skip needs its reason: <!-- docs-check: skip: REASON -->")
        block.skip = skip.group(1)
    elif text == "instead of the block above":
        block.instead = True
    else:
        raise DocsError(
            f"{where}: unknown docs-check marker {text!r} (known: 'skip: REASON', 'instead of the block above')"
        )


def user_environment() -> dict[str, str]:
    """The checker's environment as a fresh terminal's: no virtual environment active, nothing of make's."""
    environment = {key: value for key, value in os.environ.items() if key not in DROPPED_VARIABLES}
    path = [
        entry
        for entry in environment.get("PATH", "").split(os.pathsep)
        if entry and not (Path(entry).parent / "pyvenv.cfg").exists()
    ]
    environment["PATH"] = os.pathsep.join(path)
    # pip refuses to install outside a virtual environment (as on a system whose Python is externally managed): a
    # document that installs before it creates and activates one fails here instead of changing the machine's Python.
    environment["PIP_REQUIRE_VIRTUALENV"] = "true"
    return environment


def git(*args: str, cwd: Path) -> str:
    return subprocess.run(["git", *args], cwd=cwd, check=True, capture_output=True, text=True).stdout.strip()


class Tree:
    """Where the commands run: a fresh clone of a commit, or a copy of a working tree."""

    def __init__(self, repository: Path, source: Path | None, workdir: Path) -> None:
        self.repository, self.source, self.workdir = repository, source, workdir
        self.commit = git("rev-parse", "HEAD", cwd=repository) if source is None else ""
        self.count = 0

    def describe(self) -> str:
        if self.source is not None:
            return f"copies of the working tree {self.source} (its tracked and untracked, not ignored, files)"
        return (
            f"fresh clones of {self.repository} at HEAD {self.commit[:12]} (uncommitted changes are not checked; "
            "--source DIR checks a working tree)"
        )

    def read(self, file: str) -> str:
        """A file as the fresh trees will have it."""
        if self.source is not None:
            return (self.source / file).read_text()
        return git("show", f"{self.commit}:{file}", cwd=self.repository)

    def fresh(self, name: str) -> Path:
        self.count += 1
        target = self.workdir / f"{self.count}-{name}"
        if self.source is None:
            subprocess.run(["git", "clone", "--quiet", "--no-checkout", str(self.repository), str(target)], check=True)
            subprocess.run(["git", "-C", str(target), "checkout", "--quiet", "--detach", self.commit], check=True)
            return target
        listing = subprocess.run(
            ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
            cwd=self.source,
            check=True,
            capture_output=True,
        ).stdout.decode()
        for relative in filter(None, listing.split("\0")):
            origin = self.source / relative
            if origin.is_file() and not origin.is_symlink():
                (target / relative).parent.mkdir(parents=True, exist_ok=True)
                shutil.copy2(origin, target / relative)
            elif origin.is_symlink():
                (target / relative).parent.mkdir(parents=True, exist_ok=True)
                os.symlink(os.readlink(origin), target / relative)
        return target


def tail(log: Path) -> list[str]:
    with log.open("rb") as handle:
        handle.seek(max(0, log.stat().st_size - 65536))
        text = handle.read().decode(errors="replace")
    lines = [line.rstrip() for line in text.replace("\r", "\n").split("\n") if line.strip()]
    return [line if len(line) <= 300 else line[:300] + " ..." for line in lines[-TAIL_LINES:]]


def end_group(process: subprocess.Popen[bytes]) -> bool:
    """End whatever the command left running in its process group; True if anything was left."""
    try:
        os.killpg(process.pid, 0)
    except ProcessLookupError:
        return False
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(process.pid, sig)
        except ProcessLookupError:
            break
        time.sleep(2)
    return True


class Shell:
    """One terminal: commands run one at a time in the tree's root; exported variables carry over."""

    def __init__(self, root: Path, logs: Path, timeout: float) -> None:
        self.root, self.logs, self.timeout = root, logs, timeout
        self.environment = user_environment()
        self.count = 0

    def run(self, command: str) -> tuple[int | None, float, Path]:
        """(exit status, or None on a timeout; seconds; the log of its output)."""
        self.count += 1
        log = self.logs / f"{self.root.name}-{self.count:02d}.log"
        state = self.logs / f"{self.root.name}-{self.count:02d}.env"
        script = f'{command}\n__docs_check_status=$?\nenv -0 > "{state}"\nexit $__docs_check_status\n'
        started = time.monotonic()
        with log.open("wb") as output:
            process = subprocess.Popen(
                ["bash", "--noprofile", "--norc", "-c", script],
                cwd=self.root,
                env=self.environment,
                stdin=subprocess.DEVNULL,
                stdout=output,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
            try:
                status: int | None = process.wait(timeout=self.timeout)
            except subprocess.TimeoutExpired:
                end_group(process)
                process.wait()
                status = None
        seconds = time.monotonic() - started
        if status is not None and end_group(process):
            print("    (it left processes running; ended them)", flush=True)
        if status == 0 and state.exists():
            entries = (entry.split("=", 1) for entry in state.read_bytes().decode(errors="replace").split("\0"))
            self.environment = {
                pair[0]: pair[1] for pair in entries if len(pair) == 2 and pair[0] not in SHELL_OWN_VARIABLES
            }
        return status, seconds, log


def check(files: list[str], tree: Tree, logs: Path, timeout: float) -> bool:
    documents = {file: parse(file, tree.read(file)) for file in files}  # every file's markers, before typing any
    print(f"docs-check: typing {', '.join(files)} as a user would, in {tree.describe()}", flush=True)
    skipped: list[str] = []
    not_typed: list[str] = []
    ran = 0
    for file in files:
        root = tree.fresh(Path(file).stem)
        shell = Shell(root, logs, timeout)
        print(f"\n== {file} (in {root}, a new shell)", flush=True)
        typed: list[Block] = []  # the typed blocks so far, in order
        for block in documents[file]:
            if block.language != "bash":
                not_typed.append(f"{file}:{block.line} ```{block.language}")
                continue
            if block.skip is not None:
                for command in block.commands:
                    note = f"{file}:{command.line}: {one_line(command.text)}  -- {block.skip}"
                    skipped.append(note)
                    print(f"  SKIP {note}", flush=True)
                continue
            if block.instead:
                if not typed:
                    raise DocsError(f"{file}:{block.line - 1}: 'instead of the block above' with no typed block above")
                replaced = typed.pop()
                root = tree.fresh(Path(file).stem)
                shell = Shell(root, logs, timeout)
                replay = [command for earlier in typed for command in earlier.commands]
                print(
                    f"  -- {file}:{block.line}: instead of the block at line {replaced.line}: a new clone ({root}) "
                    f"and a new shell, with the {len(replay)} command(s) before that block typed again",
                    flush=True,
                )
                for command in replay:
                    ran += 1
                    if not run(shell, file, command):
                        return False
            for command in block.commands:
                ran += 1
                if not run(shell, file, command):
                    return False
            typed.append(block)
    print(f"\ndocs-check: passed: {ran} command(s) typed, {len(skipped)} skipped:", flush=True)
    for note in skipped:
        print(f"  skipped {note}")
    print(f"not typed (not bash): {', '.join(not_typed) or 'none'}")
    return True


def one_line(command: str) -> str:
    return " ".join(command.replace("\\\n", " ").split())


def run(shell: Shell, file: str, command: Command) -> bool:
    print(f"  $ {one_line(command.text)}    [{file}:{command.line}]", flush=True)
    status, seconds, log = shell.run(command.text)
    if status == 0:
        print(f"    ok, {seconds:.1f} s", flush=True)
        return True
    why = (
        f"ran past its limit, {shell.timeout:.0f} s (--timeout)"
        if status is None
        else f"exit status {status} after {seconds:.1f} s"
    )
    print(f"\ndocs-check: FAILED at {file}:{command.line}", file=sys.stderr)
    print(f"  command: {one_line(command.text)}", file=sys.stderr)
    print(f"  {why}, in {shell.root}; its whole output: {log}", file=sys.stderr)
    print("  the last lines of its output:", file=sys.stderr)
    lines = tail(log) or ["(no output)"]
    for line in lines:
        print(f"  | {line}", file=sys.stderr)
    if any("Could not find an activated virtualenv" in line for line in lines):
        print(
            "  (pip runs with PIP_REQUIRE_VIRTUALENV here: this installs before a virtual environment is active)",
            file=sys.stderr,
        )
    return False


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("files", nargs="*", default=list(DEFAULT_FILES), help="Markdown files, relative to the root")
    parser.add_argument(
        "--source", type=Path, help="type the commands in a copy of this working tree, not a clone of HEAD"
    )
    parser.add_argument("--repository", type=Path, default=ROOT, help="the repository to clone (default: this one)")
    parser.add_argument("--timeout", type=float, default=900, help="seconds one command may take (default: 900)")
    parser.add_argument("--keep", action="store_true", help="keep the clones and logs, also when the check passes")
    args = parser.parse_args()
    source = args.source.resolve() if args.source else None
    workdir = Path(tempfile.mkdtemp(prefix="docs-check-"))
    logs = workdir / "logs"
    logs.mkdir()
    started = time.monotonic()
    try:
        passed = check(args.files, Tree(args.repository.resolve(), source, workdir), logs, args.timeout)
    except DocsError as error:
        print(f"docs-check: {error}", file=sys.stderr)
        passed = False
    minutes, seconds = divmod(time.monotonic() - started, 60)
    print(f"docs-check: {'passed' if passed else 'FAILED'} in {int(minutes)} min {seconds:.0f} s", flush=True)
    if passed and not args.keep:
        shutil.rmtree(workdir, ignore_errors=True)
    else:
        print(f"docs-check: the clones and every command's output are kept in {workdir}")
    return 0 if passed else 1


if __name__ == "__main__":
    sys.exit(main())
