"""FTStrategy's argument table (docs/configuration.md) is generated from the arguments' one definition."""

from __future__ import annotations

import importlib.util
import inspect
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]


def generator():
    spec = importlib.util.spec_from_file_location("argument_table", REPO / "docs" / "argument_table.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_page_holds_the_table_the_one_definition_gives():
    table = generator()
    source = table.SOURCE.read_text()
    assert table.is_current(table.PAGE.read_text(), source), "run `python docs/argument_table.py`"
    # It can fail: an edited doc, or an edited default, makes the page out of date.
    edited_doc = source.replace("This group's id, in", "The id of this group, in", 1)
    edited_default = source.replace("timeout: float = 60.0,", "timeout: float = 61.0,", 1)
    assert edited_doc != source and edited_default != source
    assert not table.is_current(table.PAGE.read_text(), edited_doc)
    assert not table.is_current(table.PAGE.read_text(), edited_default)


def test_every_argument_of_the_signature_has_its_row_and_its_default():
    """The rows are the signature's parameters, in order, each with the default Python sees."""
    from lightning_ft.strategy_arguments import FTStrategyArguments

    rows = generator().arguments(generator().SOURCE.read_text())
    parameters = inspect.signature(FTStrategyArguments.__init__).parameters
    wanted = [("**kwargs" if name == "kwargs" else name) for name in parameters if name != "self"]
    assert [name for name, _, _ in rows] == wanted
    for name, default, doc in rows:
        assert doc.strip(), name
        if name != "**kwargs":
            assert eval(default) == parameters[name].default, name  # the signature's own literal


def test_ftstrategy_sees_the_same_signature():
    """FTStrategy takes its constructor from FTStrategyArguments: what LightningCLI reads from either is the same."""
    from lightning_ft import FTStrategy
    from lightning_ft.strategy_arguments import FTStrategyArguments

    assert inspect.signature(FTStrategy) == inspect.signature(FTStrategyArguments)
    assert "__init__" not in vars(FTStrategy)
