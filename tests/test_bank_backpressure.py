"""Backpressure on a real redis-server: push_group never takes the bank over bank.max_bytes,
a bank that cannot hold one training step is refused at its first group in one line, and a
producer waiting for space says so periodically."""

from __future__ import annotations

import logging

import pytest
from bank_helpers import make_group

from common.config import ConfigError
from memory_bank.bank import check_step_fits
from memory_bank.errors import BankFull, BankTooSmall

MB = 1 << 20


@pytest.mark.parametrize("bank", [{"max_bytes": MB}], indirect=True)
def test_a_group_larger_than_the_bank_is_refused_not_stored(bank):
    grp = make_group(g=8)                         # about 1.4 MB of latents
    with pytest.raises(BankFull, match=f"over bank.max_bytes={MB}"):
        bank.push_group(grp)
    st = bank.stats()
    assert (st["fresh"], st["entries"], st["bytes"], st["queued_bytes"]) == (0, 0, 0, 0)
    assert list(bank.r.scan_iter(match=f"{bank.keys.namespace}:e:*")) == []


@pytest.mark.parametrize("bank", [{"max_bytes": MB}], indirect=True)
def test_a_step_that_cannot_fit_is_refused_at_the_first_group(bank):
    bank.expect_step(4)                           # the driver calls this at setup
    grp = make_group(g=2)                         # one group fits, four do not
    with pytest.raises(BankTooSmall) as err:
        bank.push_group(grp)
    msg = str(err.value)
    assert isinstance(err.value, ConfigError)     # the CLI prints it as one line, exit 2
    assert "\n" not in msg and f"bank.max_bytes={MB}" in msg and "train.groups_per_step=4" in msg
    per_group = int(msg.split(" x ")[1].split(" bytes")[0])
    assert 4 * per_group > MB >= per_group and f"at least {4 * per_group}" in msg
    assert bank.stats()["fresh"] == 0
    bank.expect_step(1)
    assert bank.push_group(grp) == grp.group_id   # a step of one group fits


def test_check_step_fits_names_both_numbers():
    check_step_fits(4, 250_000, MB)
    with pytest.raises(BankTooSmall, match=r"bank.max_bytes=1048576 .* = 1330000 bytes"):
        check_step_fits(1, 1_330_000, MB)


@pytest.mark.parametrize("bank", [{"max_bytes": MB}], indirect=True)
def test_waiting_for_space_logs_periodically(bank, caplog):
    bank.push_group(make_group(g=4))              # ~690 kB: a second one does not fit
    caplog.set_level(logging.WARNING, logger="memory_bank.bank")
    assert bank.wait_for_space(0.5, poll_s=0.01, log_every_s=0.1) is False
    lines = [r.getMessage() for r in caplog.records if "full for" in r.getMessage()]
    assert len(lines) >= 2
    assert f"of bank.max_bytes={MB} bytes" in lines[0] and "wait for the learner" in lines[0]
    bank.commit(bank.pull(1, 0), 1)               # the learner drains it: space again
    assert bank.wait_for_space(0.5) is True
