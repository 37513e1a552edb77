"""The export's model card names the loss the run trained with as the loss table describes it: CE plus lambda
times a term for the digit losses, and no lambda for dft, which weights CE itself instead of adding to it."""

from __future__ import annotations

import re

import pytest

from delft.export.report import ExportResult, model_card
from delft.losses.registry import LOSS_TYPES


def loss_row(tmp_path, loss: str, weight: float) -> str:
    card = model_card(ExportResult(str(tmp_path / "out"), str(tmp_path), "base-model", "16-bit", "merged", "float32"),
                      {"loss": loss, "loss_weight": weight}, None, [], tmp_path)
    rows = re.findall(r"^\| loss \| (.*) \|$", card, re.M)
    assert len(rows) == 1, card
    return rows[0]


def test_dft_is_described_as_weighted_ce_not_ce_plus_a_term(tmp_path):
    row = loss_row(tmp_path, "dft", 0.0)
    assert "CE +" not in row and "lambda" not in row
    assert row.startswith("dft: ") and "detached probability of the label" in row and "in place of CE" in row


def test_a_digit_loss_is_ce_plus_lambda_times_its_term(tmp_path):
    assert loss_row(tmp_path, "del_prob", 0.3) == "CE + lambda x del_prob with lambda = 0.3"
    assert loss_row(tmp_path, "ce", 0.0) == "ce: cross-entropy only, no digit term"


@pytest.mark.parametrize("name", sorted(LOSS_TYPES))
def test_every_loss_in_the_table_gets_a_lambda_only_when_it_adds_a_term(tmp_path, name):
    row = loss_row(tmp_path, name, 0.5)
    assert ("lambda = 0.5" in row) == (name not in ("ce", "dft"))
