"""What a worker prints once that tells a user of many groups nothing: Lightning's process-group banner."""

from __future__ import annotations

import logging

from lightning.fabric.utilities.rank_zero import rank_zero_info

from lightning_ft.loop_patches import without_process_group_banner


def _banner() -> None:
    # What lightning.fabric.utilities.distributed._init_dist_connection prints on rank 0.
    rank_zero_info(
        f"{'-' * 100}\ndistributed_backend=gloo\nAll distributed processes registered. Starting with 1 processes\n"
    )


def test_the_process_group_banner_is_dropped_and_only_around_the_setup(caplog):
    with caplog.at_level(logging.INFO):
        with without_process_group_banner():
            _banner()
            rank_zero_info("something else")
        _banner()
    messages = [record.getMessage() for record in caplog.records]
    assert messages.count("something else") == 1
    assert sum("All distributed processes registered" in m for m in messages) == 1  # the one outside the block
