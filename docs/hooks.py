"""MkDocs hooks of the docs site (``hooks:`` in mkdocs.yml; ``exclude_docs`` keeps this file out of the site).

* The CLI reference: ``<!-- lightning-ft commands -->`` in ``reference/cli.md`` becomes the ``--help`` of
  ``lightning-ft`` and of each of its commands, from the real parser (:func:`lightning_ft_cli.main.build_parser`,
  which imports neither torch nor Lightning), so the page lists every option the installed command has.
* Links that leave docs/ (``[`benchmarks/README.md`](../benchmarks/README.md)``) point at files of the source tree,
  which the site does not hold: on GitHub they work, in the site they would be dead. A link whose target exists in the
  repository becomes its text (the file's path in the repository); one whose target does not exist is left alone, so
  that MkDocs reports it as a broken link (and ``--strict`` fails). Links inside docs/ are MkDocs' own to check.
* :class:`PublicDocstrings`, a griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): every public name
  (``lightning_ft.__all__``) and every public method and property that its class defines has a docstring, or the
  build warns (and ``--strict`` fails): the reference shows documented members only, so none may go missing silently.
* :class:`SphinxRoles`, a griffe extension (mkdocs.yml, mkdocstrings' ``extensions``): the docstrings cross-reference
  with Sphinx roles (``:class:`~lightning_ft.settings.FTConfigError```), which Markdown would show as they are.
"""

from __future__ import annotations

import argparse
import ast
import logging
import os
import re
from pathlib import Path
from typing import Any

import griffe
from mkdocs.config.defaults import MkDocsConfig
from mkdocs.exceptions import PluginError
from mkdocs.structure.files import Files
from mkdocs.structure.pages import Page

CLI_PAGE = "reference/cli.md"
CLI_PLACEHOLDER = "<!-- lightning-ft commands -->"
# The width argparse wraps the help at (it reads COLUMNS), so that the page does not depend on the terminal.
HELP_COLUMNS = "100"

log = logging.getLogger("mkdocs.hooks.lightning_ft")

_RELATIVE_LINK = re.compile(r"\[(?P<text>[^\]\n]+)\]\((?P<target>\.\./[^)\s#]+)(?P<anchor>#[^)\s]*)?\)")


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    if page.file.src_uri == CLI_PAGE:
        if CLI_PLACEHOLDER not in markdown:
            raise PluginError(f"{CLI_PAGE} lost its placeholder {CLI_PLACEHOLDER}: the CLI reference would be empty.")
        markdown = markdown.replace(CLI_PLACEHOLDER, cli_reference())
    return _unlink_outside_docs(markdown, page, config)


def cli_reference() -> str:
    """Markdown for ``lightning-ft --help`` and each command's ``--help``, in the parser's order."""
    from lightning_ft_cli.main import build_parser

    columns = os.environ.get("COLUMNS")
    os.environ["COLUMNS"] = HELP_COLUMNS
    try:
        parser = build_parser()
        sections = ["```text\n" + parser.format_help() + "```"]
        # argparse exposes a parser's commands only through its _SubParsersAction.
        commands = next(a for a in parser._actions if isinstance(a, argparse._SubParsersAction))
        summaries = {action.dest: action.help or "" for action in commands._choices_actions}
        for name, command in commands.choices.items():
            summary = summaries.get(name, "")
            summary = summary[:1].upper() + summary[1:] + "." if summary else ""
            sections.append(f"## `lightning-ft {name}`\n\n{summary}\n\n```text\n{command.format_help()}```")
    finally:
        if columns is None:
            os.environ.pop("COLUMNS", None)
        else:
            os.environ["COLUMNS"] = columns
    return "\n\n".join(sections)


def _unlink_outside_docs(markdown: str, page: Page, config: MkDocsConfig) -> str:
    """Replace each link to an existing file outside docs/ with its text; fenced code is left as it is."""
    docs = Path(config.docs_dir).resolve()
    repository = Path(config.config_file_path).resolve().parent
    assert page.file.abs_src_path is not None
    here = Path(page.file.abs_src_path).parent

    def replace(match: re.Match[str]) -> str:
        target = (here / match["target"]).resolve()
        if target.is_relative_to(docs) or not target.is_relative_to(repository) or not target.exists():
            return match[0]  # MkDocs checks it (and reports it if it is broken)
        text = match["text"]
        path = target.relative_to(repository).as_posix()
        return text if path in text else f"{text} (`{path}` in the repository)"

    lines, fenced = [], False
    for line in markdown.split("\n"):
        if line.lstrip().startswith(("```", "~~~")):
            fenced = not fenced
        lines.append(line if fenced else _RELATIVE_LINK.sub(replace, line))
    return "\n".join(lines)


_ROLE = re.compile(r":(?:py:)?(?P<role>mod|class|func|meth|attr|exc|data|obj|const):`(?P<short>~?)(?P<target>[^`]+)`")
_LINKED_ROLES = ("class", "func", "exc", "obj")


def _public_names() -> frozenset[str]:
    """``lightning_ft.__all__``, read from the source: what the API reference renders under ``lightning_ft.``."""
    source = (Path(__file__).resolve().parents[1] / "lightning_ft" / "__init__.py").read_text()
    for node in ast.parse(source).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "__all__" for t in node.targets):
            return frozenset(ast.literal_eval(node.value))
    raise PluginError("lightning_ft/__init__.py has no __all__")


class PublicDocstrings(griffe.Extension):
    """Warn about each public name of ``lightning_ft`` without a docstring, and each public method or property that its
    class defines (not inherits) without one. Attributes are documented in their class's docstring instead."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        if pkg.name != "lightning_ft":
            return
        for name in sorted(_public_names()):
            if name.startswith("__"):
                continue
            obj = pkg[name]
            target = obj.final_target if isinstance(obj, griffe.Alias) else obj
            if target.docstring is None:
                log.warning("lightning_ft.%s has no docstring", name)
            if not isinstance(target, griffe.Class):
                continue
            for member_name, member in target.members.items():
                if member_name.startswith("_") or isinstance(member, griffe.Alias) or member.docstring is not None:
                    continue
                if isinstance(member, griffe.Function) or "property" in member.labels:
                    log.warning("lightning_ft.%s.%s has no docstring", name, member_name)


class SphinxRoles(griffe.Extension):
    """Turn each Sphinx role of a docstring into Markdown: a link to the API reference when it names a public class,
    function or error of ``lightning_ft`` (rendered there as ``lightning_ft.<name>``), else the name as code
    (``~`` shows the last component only, as in Sphinx)."""

    def __init__(self) -> None:
        super().__init__()
        self._public = _public_names()

    def on_object(self, *, obj: griffe.Object, **kwargs: Any) -> None:
        if obj.docstring is not None and ":" in obj.docstring.value:
            obj.docstring.value = _ROLE.sub(self._markdown, obj.docstring.value)

    def _markdown(self, match: re.Match[str]) -> str:
        target = match["target"]
        name = target.rsplit(".", 1)[-1]
        shown = name if match["short"] else target
        if match["role"] in _LINKED_ROLES and name in self._public:
            return f"[`{shown}`][lightning_ft.{name}]"
        return f"`{shown}`"
