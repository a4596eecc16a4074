"""The runner's multi-turn hook: after an answer without tool calls, an environment with
`next_user_message()` supplies the next user turn (BFCL multi-turn works this way)."""

from lopd_cli.agent.runner import run_episodes
from lopd_cli.agent.types import Task
from lopd_cli.config import RolloutSection
from lopd_cli.models.backbone import load_backbone


class TwoTurnEnv:
    """No tools; two user turns. Reward = number of user turns delivered / 2."""

    def __init__(self):
        self.turn = 0

    def tasks(self, split):
        return [Task(id=f"t{i}", instruction=f"Say hello {i}", tools=[]) for i in range(3)]

    def reset(self, task):
        self.turn = 0
        return [{"role": "system", "content": "Be brief."}, {"role": "user", "content": task.instruction}]

    def step(self, call):
        return "no tools here"

    def next_user_message(self):
        if self.turn >= 1:
            return None
        self.turn += 1
        return {"role": "user", "content": "And now say goodbye."}

    def reward(self, transcript):
        return sum(m["role"] == "user" for m in transcript) / 2


def test_next_user_message_continues_the_episode():
    model, tok = load_backbone("tiny")
    cfg = RolloutSection(max_new_tokens=8, max_turns=4, batch_size=3)
    eps = run_episodes(model, tok, TwoTurnEnv, TwoTurnEnv().tasks("train"), cfg, seed=1)
    for ep in eps:
        assert ep.error is None
        roles = [m["role"] for m in ep.messages]
        assert roles.count("user") == 2 and roles.count("assistant") == 2, roles
        assert ep.reward == 1.0 and ep.meta["turns"] == 2
        assert len(ep.turn_spans) == 2
        # the second user turn's tokens lie between the two generated turns, with mask 0
        (a0, a1), (b0, b1) = ep.turn_spans
        assert all(m == 0 for m in ep.action_mask[a1:b0]) and b0 > a1
        assert "<|im_start|>user\nAnd now say goodbye.<|im_end|>" in tok.decode(ep.input_ids[a1:b0])


def test_max_turns_stops_before_the_next_user_turn():
    model, tok = load_backbone("tiny")
    cfg = RolloutSection(max_new_tokens=8, max_turns=1, batch_size=3)
    eps = run_episodes(model, tok, TwoTurnEnv, TwoTurnEnv().tasks("train")[:1], cfg, seed=1)
    assert [m["role"] for m in eps[0].messages].count("user") == 1 and eps[0].meta["stop"] == "answer"
