"""`--tree auto`'s policy (autotune.Policy): one test per transition of the module docstring's diagram,
driven by reports alone (no model): AR steps take 1 s a token, a drafting plan commits 2 tokens an
iteration in the seconds the test gives it."""

from __future__ import annotations

import pytest

from tokenswift_trt.decode import autotune
from tokenswift_trt.decode.autotune import Phase, Plan, Policy, Report
from tokenswift_trt.decode.tree import TreeSpec

PICK = Plan(TreeSpec.parse("1,1"), 0)
THREE = TreeSpec.parse("3")
LIMIT = 100_000  # tokens a generation may commit: a long one, so the budget holds several probes


class Driver:
    """A policy probing on AR steps, fed iterations as the decode loop would; `choose` returns
    `picks` in turn (then AR steps), `rechoose` returns `better` (None: keep the audited plan)."""

    def __init__(self, picks=(PICK,), better=None, limit=LIMIT, shadow_s=0.0):
        self.picks, self.better, self.limit, self.position = list(picks), better, limit, 1
        self.policy = Policy(Plan(None, 0), autotune.SHADOW_PROBE_STEPS, self.choose, lambda plan: better)
        self.policy.budget.shadow_s = shadow_s
        self.samples = 0

    def choose(self) -> Plan:
        return self.picks.pop(0) if self.picks else Plan(None, 0)

    def step(self, drafting_seconds_per_token: float = 0.5) -> Plan:
        """One iteration of the current plan (a run of AR steps where the policy allows one)."""
        plan, policy = self.policy.plan, self.policy
        if plan.tree is None:
            tokens = max(1, policy.plain_ar_steps(self.position))
            seconds, drafted = float(tokens), False
            self.samples += plan.probe
        else:
            tokens, seconds, drafted = 2, 2 * drafting_seconds_per_token, True
        self.position += tokens
        return policy.next(
            Report(tokens, seconds, drafted, self.position, self.limit - self.position), self.samples
        )

    def run_while(self, phase: Phase, drafting_seconds_per_token: float = 0.5) -> Plan:
        while self.policy.phase is phase:
            self.step(drafting_seconds_per_token)
        return self.policy.plan


def test_start_probe():
    driver = Driver()
    assert driver.policy.phase is Phase.PROBE and str(driver.policy.plan) == "probe on ar steps from token 1"
    assert driver.policy.plain_ar_steps(1) == 0  # every probe step is reported: it drafts after each
    assert driver.policy.shadow_wanted(LIMIT)


def test_probe_to_ar_when_the_probe_would_overrun_the_budget():
    """900 tokens of 1 s give 9 s to explore; a choice is costed at CHOOSE_COST_STEPS steps."""
    driver = Driver(limit=900)
    driver.step()
    assert driver.policy.phase is Phase.AR and driver.position == 2  # abandoned after its first step
    assert autotune.EXPLORATION_BUDGET * 900 < autotune.CHOOSE_COST_STEPS


def test_probe_to_ar_when_the_choice_is_ar_steps():
    driver = Driver(picks=[Plan(None, 0)])
    plan = driver.run_while(Phase.PROBE)
    assert driver.policy.phase is Phase.AR and plan.tree is None
    assert driver.samples == autotune.SHADOW_PROBE_STEPS
    assert driver.policy.plain_ar_steps(driver.position) == autotune.RETUNE_AFTER_AR


def test_probe_to_trial_with_the_pick_first():
    driver = Driver()
    plan = driver.run_while(Phase.PROBE)
    assert driver.policy.phase is Phase.TRIAL and (plan.tree, plan.trial) == (PICK.tree, True)
    assert driver.policy.plain_ar_steps(driver.position) == 0


def test_trial_to_draft_when_the_pick_is_clearly_faster():
    driver = Driver()
    driver.run_while(Phase.PROBE)
    plan = driver.run_while(Phase.TRIAL, drafting_seconds_per_token=0.9)
    assert driver.policy.phase is Phase.DRAFT and plan.tree == PICK.tree and not plan.trial
    turns = [p for p in driver.policy.history if p.trial]
    assert [p.tree for p in turns] == [PICK.tree, None] * autotune.TURNS  # taking turns


@pytest.mark.parametrize("seconds", [0.99, 2.0])
def test_trial_to_ar_when_the_pick_is_not_faster_by_the_margin(seconds):
    driver = Driver()
    driver.run_while(Phase.PROBE)
    plan = driver.run_while(Phase.TRIAL, drafting_seconds_per_token=seconds)
    assert driver.policy.phase is Phase.AR and plan.tree is None
    turns = [p for p in driver.policy.history if p.trial]
    # twice AR's time is given up after one pair of turns; 1% slower is judged on all of them
    assert len(turns) == (2 if seconds >= autotune.TRIAL_GIVE_UP else 2 * autotune.TURNS)


def test_audit_after_audit_every_tokens_with_ar_steps_first():
    driver = Driver()
    driver.run_while(Phase.PROBE)
    driver.run_while(Phase.TRIAL)
    kept = driver.position
    plan = driver.run_while(Phase.DRAFT)
    assert driver.policy.phase is Phase.AUDIT and (plan.tree, plan.audit) == (None, True)
    assert kept + autotune.AUDIT_EVERY <= driver.position <= kept + autotune.AUDIT_EVERY + 2


def test_audit_to_ar_when_the_plan_stopped_paying():
    driver = Driver()
    driver.run_while(Phase.PROBE)
    driver.run_while(Phase.TRIAL)
    driver.run_while(Phase.DRAFT)
    plan = driver.run_while(Phase.AUDIT, drafting_seconds_per_token=1.1)
    assert driver.policy.phase is Phase.AR and plan.tree is None


def test_audit_to_draft_with_audits_further_apart_then_none_once_clearly_faster():
    driver = Driver()
    driver.run_while(Phase.PROBE)
    driver.run_while(Phase.TRIAL)
    gaps, since = [], driver.position
    for _ in range(2):  # 0.9 s a token: passes, not clearly (AUDIT_CLEAR)
        driver.run_while(Phase.DRAFT, 0.9)
        gaps.append(driver.position - since)
        plan = driver.run_while(Phase.AUDIT, 0.9)
        assert driver.policy.phase is Phase.DRAFT and plan.tree == PICK.tree
        since = driver.position
    every = autotune.AUDIT_EVERY
    assert every <= gaps[0] <= every + 2 and 2 * every <= gaps[1] <= 2 * every + 2  # doubling
    driver = Driver()
    driver.run_while(Phase.PROBE)
    driver.run_while(Phase.TRIAL)
    driver.run_while(Phase.DRAFT)
    driver.run_while(Phase.AUDIT, 0.5)  # clearly faster: no audit until the next probe
    driver.run_while(Phase.DRAFT, 0.5)
    assert driver.policy.phase is Phase.PROBE


def test_audit_to_trial_when_the_samples_since_favour_another_plan():
    better = Plan(THREE, 0)
    for seconds, kept in ((2.0, PICK.tree), (0.3, THREE)):
        driver = Driver(better=better)
        driver.run_while(Phase.PROBE)
        driver.run_while(Phase.TRIAL)
        driver.run_while(Phase.DRAFT)
        plan = driver.run_while(Phase.AUDIT)
        assert driver.policy.phase is Phase.TRIAL and (plan.tree, plan.trial) == (THREE, True)
        while driver.policy.phase is Phase.TRIAL:
            driver.step(seconds if driver.policy.plan.tree == THREE else 0.5)
        # lost: the audited plan runs on (not AR steps); won: the new one is kept
        assert driver.policy.phase is Phase.DRAFT and driver.policy.plan.tree == kept


def test_draft_to_probe_after_retune_every_tokens():
    driver = Driver()
    driver.run_while(Phase.PROBE)
    driver.run_while(Phase.TRIAL, 0.3)
    kept = driver.position
    while driver.policy.phase is not Phase.PROBE:
        driver.step(0.3)
    assert driver.position >= kept + autotune.RETUNE_EVERY and driver.policy.plan.probe


def test_ar_to_probe_when_due_and_within_budget_else_ar_again():
    driver = Driver(picks=[Plan(None, 0)])
    driver.run_while(Phase.PROBE)
    settled = driver.position
    driver.step()  # one run of plain AR steps, to the next probe
    assert driver.position == settled + autotune.RETUNE_AFTER_AR and driver.policy.phase is Phase.PROBE
    # the same with the budget spent: AR steps again, the probe put off
    driver = Driver(picks=[Plan(None, 0)])
    driver.run_while(Phase.PROBE)
    driver.policy.budget.spent_s = LIMIT  # as if exploring had cost the whole generation's time
    driver.step()
    assert driver.policy.phase is Phase.AR and driver.policy.plain_ar_steps(driver.position) > 0


def test_the_budget_counts_what_drafting_saves_and_loses_against_ar_steps():
    budget = autotune.Budget(share=0.02)
    budget.account(Report(64, 64.0, False, 65, 1000))  # AR steps: 1 s a token
    assert budget.ar_s_per_token == 1.0
    budget.account(Report(2, 1.0, True, 67, 998))  # a drafting iteration: 2 tokens in 1 s
    assert budget.saved_s == pytest.approx(1.0)
    budget.spent_s = 3.0
    assert budget.allowance(998) == pytest.approx(0.02 * (65.0 + 998) + 1.0 - 3.0)
