"""Index + retrieval with the real embedded embedder (all-MiniLM-L6-v2) on a small bank:
paraphrased queries find the right rollout, exclusions still return k, ties are deterministic,
the index is incremental, stale fingerprints are refused, rm reaches the index, HNSW works."""

import json
import shutil

import numpy as np
import pytest

from lopd_cli.bank.index import VectorIndex, build_index
from lopd_cli.bank.retrieve import Retriever
from lopd_cli.bank.store import Bank
from lopd_cli.cli.main import run
from lopd_cli.config import recipe_from_dict
from lopd_cli.errors import LopdError
from lopd_cli.project import init_project, open_project

TOPICS = {
    "refund": ("Refund order 4821 because the item arrived broken", "I want my money back for a damaged package"),
    "address": ("Change the shipping address of order 1290 to 12 Baker Street, London", "update where my parcel gets delivered to a new street"),
    "subscription": ("Cancel my subscription to the premium plan", "stop my premium membership billing"),
    "weather": ("What is the weather forecast for Tokyo tomorrow?", "will it rain in Tokyo tomorrow"),
    "restaurant": ("Book a table for two at an Italian restaurant tonight", "reserve dinner for 2 people at a pasta place this evening"),
    "password": ("Reset the password for my email account", "I forgot my email login credentials"),
    "currency": ("Convert 100 US dollars to euros", "how many EUR is 100 USD"),
    "code": ("Write a Python function that reverses a linked list", "python code to invert a singly linked list"),
    "flights": ("Find flights from New York to San Francisco next Monday", "plane tickets NYC to SF on monday"),
    "tracking": ("Track the delivery status of package 5531", "where is my shipment 5531 right now"),
    "meeting": ("Schedule a meeting with the marketing team on Friday at 3pm", "set up a call with marketing colleagues friday afternoon"),
    "translate": ("Translate 'good morning' into Spanish", "how do you say good morning in spanish"),
    "circle": ("Calculate the area of a circle with radius 5", "what is pi r squared for r = 5"),
    "grocery": ("Add milk and eggs to my grocery shopping list", "put eggs and milk on the shopping list"),
    "music": ("Play some relaxing jazz music", "put on calm jazz songs"),
    "alarm": ("Set an alarm for 6:30 am", "wake me up at half past six in the morning"),
}


def rollout(task_id, instruction, reward=1.0, answer="done"):
    return {"task_id": task_id, "instruction": instruction, "reward": reward,
            "messages": [{"role": "user", "content": instruction},
                         {"role": "assistant", "content": None, "tool_calls": [
                             {"id": "c1", "type": "function", "function": {"name": "act", "arguments": {"q": task_id}}}]},
                         {"role": "tool", "tool_call_id": "c1", "content": "result " * 200},
                         {"role": "assistant", "content": answer}],
            "meta": {"env": "test"}}


def recipe(**bank):
    return recipe_from_dict({"model": {"backbone": "tiny"}, "env": {"class": "lopd_cli.envs.orders:OrdersEnv"},
                             "bank": bank})


@pytest.fixture(scope="module")
def built(tmp_path_factory):
    """A project with the 16 topics (successful) and failed look-alikes, indexed."""
    proj = init_project(tmp_path_factory.mktemp("bank") / "proj", example="orders", model="tiny")
    bank = Bank(proj.bank_path())
    recs = [rollout(t, instr) for t, (instr, _) in TOPICS.items()]
    recs += [rollout(f"{t}-failed", instr, reward=0.0, answer="gave up") for t, (instr, _) in list(TOPICS.items())[:4]]
    assert bank.add_records(recs).added == 20
    report = build_index(proj, None, progress=False)
    assert (report.added, report.total, report.removed) == (16, 16, 0)
    return proj


@pytest.fixture
def project(built, tmp_path):
    """A private copy of the built project (tests may change it)."""
    dst = tmp_path / "proj"
    shutil.copytree(built.root, dst)
    return open_project(dst)


def test_paraphrases_find_the_right_rollout(built):
    r = Retriever.open(built, None)
    assert len(r) == 16  # failed rollouts are not indexed
    queries = [q for _, q in TOPICS.values()]
    got = r.retrieve_many(queries, k=1)
    assert [g[0].task_id for g in got] == list(TOPICS)
    assert all(g[0].success and g[0].score > 0.3 for g in got)
    # batched and one-by-one retrieval agree
    assert [[i.id for i in g] for g in r.retrieve_many(queries[:5], k=3)] == \
           [[i.id for i in r.retrieve(q, k=3)] for q in queries[:5]]


def test_exclusions_still_return_k(built):
    r = Retriever.open(built, None)
    q = TOPICS["refund"][1]
    top = r.retrieve(q, k=3)
    assert top[0].task_id == "refund" and len(top) == 3
    no_self = r.retrieve(q, k=3, exclude_task_ids=["refund"])
    assert len(no_self) == 3 and "refund" not in {i.task_id for i in no_self}
    assert [i.id for i in no_self[:2]] == [i.id for i in top[1:]]
    by_text = r.retrieve(q, k=3, exclude_instructions=[TOPICS["refund"][0] + "  "])
    assert [i.id for i in by_text] == [i.id for i in no_self]
    # exclude all but two: over-fetch goes on until it has them
    keep = {"music", "alarm"}
    rest = r.retrieve(q, k=5, exclude_task_ids=[t for t in TOPICS if t not in keep])
    assert {i.task_id for i in rest} == keep
    scores = [i.score for i in r.retrieve(q, k=16)]
    assert scores == sorted(scores, reverse=True)


def test_ties_break_by_row_id(built, tmp_path):
    """Identical vectors inserted in reverse id order: FAISS alone would return the newest rows."""
    bank = Bank(built.bank_path())
    ids = bank.ids(success_only=True)[:6]
    v = np.ones((1, 8), np.float32) / np.sqrt(8)
    idx = VectorIndex("flat", 8, {})
    idx.add(np.asarray(ids[::-1]), np.repeat(v, 6, axis=0))

    class FixedEmbedder:  # every query embeds to the same vector as the rows
        def get_embedding_dimension(self):
            return 8

        def encode(self, texts, **kw):
            return np.repeat(v, len(texts), axis=0)

    r = Retriever(bank, idx, FixedEmbedder(), None)
    assert [i.id for i in r.retrieve("anything", k=3)] == ids[:3]
    assert [i.id for i in r.retrieve("anything", k=3, exclude_task_ids=[bank.get(ids[0]).task_id])] == ids[1:4]


def test_incremental_index_rm_and_growth(project):
    bank = Bank(project.bank_path())
    res = bank.add_records([rollout("plants", "Water the plants in the garden every morning"),
                            rollout("plants-bad", "Water the plants", reward=0.2)])
    # open() embeds rows the saved index lacks, in memory
    r = Retriever.open(project, None)
    assert len(r) == 17 and r.retrieve("irrigate my garden plants", k=1)[0].task_id == "plants"
    assert VectorIndex.load(project.index_dir()).ids.size == 16
    report = build_index(project, None, progress=False)
    assert (report.added, report.removed, report.total) == (1, 0, 17)
    assert build_index(project, None, progress=False).added == 0  # nothing new: nothing embedded
    # rm removes from the bank and the saved index
    refund_id = next(i.id for i in bank.items() if i.task_id == "refund")
    assert run(["bank", "rm", str(refund_id), "-C", str(project.root)]) is None
    assert refund_id not in VectorIndex.load(project.index_dir()).ids.tolist()
    r = Retriever.open(project, None)
    assert "refund" not in {i.task_id for i in r.retrieve(TOPICS["refund"][1], k=3)}
    # growth during training: add rows to the bank, then to the retriever
    grown = bank.add_records([rollout("bike", "Repair the flat tyre of my bicycle")])
    assert r.add(grown.ids) == 1 and r.add(grown.ids) == 0
    assert r.retrieve("fix a punctured bike wheel", k=1)[0].task_id == "bike"
    r.save()
    assert len(VectorIndex.load(project.index_dir())) == 17
    assert res.added == 2


def test_changed_settings_demand_rebuild_and_hnsw(project):
    traj = recipe(embed_text="instruction+trajectory")
    with pytest.raises(LopdError, match="--rebuild"):
        build_index(project, traj, progress=False)
    with pytest.raises(LopdError, match="embed_text"):
        Retriever.open(project, traj)
    report = build_index(project, traj, rebuild=True, progress=False)
    assert (report.added, report.total, report.rebuilt) == (16, 16, True)
    assert Retriever.open(project, traj).retrieve(TOPICS["weather"][1], k=1)[0].task_id == "weather"
    # switching to HNSW re-uses the stored vectors (no embedding)
    hnsw = recipe(embed_text="instruction+trajectory", index="hnsw")
    report = build_index(project, hnsw, progress=False)
    assert (report.added, report.total, report.kind) == (0, 16, "hnsw")
    r = Retriever.open(project, hnsw)
    assert r.index.kind == "hnsw"
    assert [g[0].task_id for g in r.retrieve_many([q for _, q in list(TOPICS.values())[:6]], k=1)] == list(TOPICS)[:6]


def test_missing_index_is_a_clear_error(tmp_path):
    proj = init_project(tmp_path / "p", example="orders", model="tiny")
    Bank(proj.bank_path()).add_records([rollout("a", "Say hello")])
    with pytest.raises(LopdError, match="no index yet"):
        Retriever.open(proj, None)


def test_search_cli(built, capsys):
    run(["bank", "search", TOPICS["currency"][1], "-k", "2", "-C", str(built.root), "--json"])
    hits = json.loads(capsys.readouterr().out)
    assert len(hits) == 2 and hits[0]["task_id"] == "currency" and hits[0]["score"] >= hits[1]["score"]


def test_query_vectors_are_embedded_once_and_alone(built, monkeypatch):
    import lopd_cli.bank.retrieve as rmod
    from lopd_cli.bank.embed import embed_texts

    r = Retriever.open(built, None)
    queries = [q for _, q in TOPICS.values()]
    batches = []
    monkeypatch.setattr(rmod, "embed_texts", lambda m, texts: batches.append(list(texts)) or embed_texts(m, texts))
    first = r.retrieve_many(queries[:4], k=2)
    again = r.retrieve_many(queries[:4] + queries[:2], k=2)
    assert batches == [[q] for q in queries[:4]], "each new text alone, repeats from the cache"
    assert [[i.id for i in g] for g in again[:4]] == [[i.id for i in g] for g in first]
    fresh = embed_texts(r.model, queries[:4])
    assert np.allclose(r.embed(queries[:4]), fresh, atol=1e-5)
