"""A discrete-event simulation of ``kvkeeper serve --replicas N``: the real routers against N simulated replicas.

No Ray, no model: pure Python, one process.  What is real and what is modelled:

* **Routers (real code)**: ``default`` -- Ray Serve's default request router, power of two choices on queue length
  (two replicas drawn at random, the one with fewer running + waiting requests; Mitzenmacher 2001);
  ``ring`` -- :class:`kvkeeper.cluster.router.Policy` with every turn carrying its conversation's ``X-Session-ID``
  (the consistent-hash ring); ``text`` -- the same ``Policy`` on text-block hashes
  (:func:`~kvkeeper.cluster.router.prompt_block_hashes`) against each replica's
  :class:`~kvkeeper.cluster.router.PrefixSummary` of the prompts it served; ``exact`` --
  :class:`kvkeeper.cluster.exact_router.ExactRouter` on a :class:`~kvkeeper.cluster.kv_index.KVIndex` fed by each
  replica's real KV events.  ``text`` and ``exact`` see no session id (clients that resend their history, as
  OpenAI clients do); ``ring`` needs one and is given it.  Load is read exactly at the decision (no staleness);
  events reach the index at the end of the step that made them.
* **Replicas (real block pool)**: each replica has a real :class:`kvkeeper.kvcache.block_pool.BlockPool`
  (refcounts, prefix cache with chained block hashes, LRU eviction of cached free blocks, KV events through the real
  :class:`~kvkeeper.kvcache.kv_events.EventRecorder`), no KV tensors.  A request is admitted (FCFS, at most
  ``max_num_seqs``) when its blocks -- prompt and reply -- can be allocated after its prefix hit; its prompt is
  prefilled in chunks within ``max_num_batched_tokens`` per step (chunked prefill, as the engine's scheduler);
  its first token comes at the end of the step that finishes its prefill; its full blocks are registered in the
  prefix cache when computed and all its blocks are freed (tail first) when it finishes.  Sessions pinning KV
  between turns, preemption and offload tiers are not modelled: between turns a conversation's KV is only what
  the prefix cache keeps (full blocks), as in ``cluster_bench --pressure`` (no host tier).
* **Costs (fit on this machine)**: a step with ``b`` decoding sequences and prefill chunks of ``n_i`` new tokens
  over ``c_i`` tokens of context takes ``d0 + d1 * b + p1 * sum(n_i) + p2 * sum(n_i * c_i)`` seconds (plus ``p0 -
  d0`` when it prefills), the coefficients from ``benchmarks/cluster/cluster_sim_costs.py`` fit to the engine
  benchmark's JSON of a quiet run (``engine_bench-smollm2-135m-2026-11-30``, 2 threads; times x 2 for replicas of 1
  thread each), in ``benchmarks/results/cluster_sim_costs/cluster_sim_costs-engine_bench-2026-12-02.json``;
  ``--costs`` names another (a short real engine run on this machine writes one, but on a machine busy with other
  jobs its times are not a cost model: ``cluster_sim_costs-measured-loaded-2026-12-02``, taken at load average 7 to
  14 on 2 cores).
* **Trace (the shipped data)**: conversations from Topical-Chat (all 539, user = agent_1, reply = agent_2's next line
  cut to ``--max-tokens`` tokens) and MT-Bench (80 questions, 2 turns; no answers shipped, so a reply is the
  question's first tokens: only a reply's length and that it is the same on every replay matter to a cache),
  rendered with SmolLM2's chat template (its default system prompt first) and tokenized with the embedded model's
  tokenizer once, cached under ``$KVKEEPER_CACHE/cluster_sim``.  Conversations arrive as a Poisson process
  (``--rate`` per replica per second), each a draw from the data (a distinct "(Conversation i.)" tag when drawn
  again), the next turn sent an exponential think time (``--think-s`` mean) after the previous reply.
* **Pool per replica**: ``--pool-fraction`` (0.5) x the working set, the time-averaged KV of the live
  conversations by Little's law: ``rate x mean over conversations of the sum over turns of (think time x blocks
  held after the turn)`` (service time left out: the working set is slightly understated).  ``--pool-basis
  cluster`` (the default) takes the working set of all conversations, as ``cluster_bench --pressure`` sizes each
  replica's pool from the KV all sessions hold; ``replica`` divides it by the replica count (every pool under
  pressure at any scale).  A replica's pool is the real ``BlockPool`` grown on demand up to that capacity
  (:meth:`Replica._grow`: it acts as the full-size pool, so 256 pools of 45k blocks cost only what they hold).

Outputs per router: ``hit_rate`` (prompt tokens from the prefix cache / prompt tokens), ``ideal_hit_rate`` (one
server with unbounded KV on the same trace), ``ttft_p50_s`` / ``ttft_p99_s`` (arrival to first token),
``load_max_over_mean`` (requests served by the busiest replica / the mean).

The command line, its reports and plots: ``benchmarks/cluster/cluster_sim.py`` (this module is the simulator it runs and
tests/unit/cluster/test_cluster_sim.py checks).
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import random
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

from kvkeeper.cluster.exact_router import ExactRouter, ReplicaLoad
from kvkeeper.cluster.kv_index import KVIndex
from kvkeeper.cluster.router import Candidate, Policy, PrefixSummary, pick, prompt_block_hashes
from kvkeeper.kvcache.block_pool import Block, BlockPool
from kvkeeper.kvcache.kv_events.wire import EventRecorder
from kvkeeper.kvcache.namespace import Namespace

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results"
TOPICAL = ROOT / "data" / "topical_chat" / "test_freq_conversations.jsonl"
MT_BENCH = ROOT / "data" / "mt_bench" / "question.jsonl"
ROUTERS = ("default", "ring", "text", "exact")
SYSTEM = "You are a helpful AI assistant named SmolLM, trained by Hugging Face"  # SmolLM2's template default
BLOCK_SIZE = 16
GROW = 4096  # blocks a replica's pool grows by on demand, up to its capacity (Replica._grow)
NAMESPACE = Namespace("cluster-sim")


# ---- cost model ------------------------------------------------------------------------------------------------
@dataclass
class Costs:
    """Seconds: a step's base (``decode_step_s``) and per decoding sequence; a prefill's fixed part, per new token
    and per new token x cached token (see the module docstring)."""

    prefill_s: float
    prefill_per_token_s: float
    prefill_per_token_context_s: float
    decode_step_s: float
    decode_per_seq_s: float
    source: str = ""

    def step(self, decoding: int, chunks: list[tuple[int, int]]) -> float:
        t = self.decode_step_s + self.decode_per_seq_s * decoding
        if chunks:
            t += max(0.0, self.prefill_s - self.decode_step_s)
            for n, c in chunks:
                t += n * (self.prefill_per_token_s + c * self.prefill_per_token_context_s)
        return t


# fit from engine_bench's quiet run (x 2)
COSTS = RESULTS / "cluster_sim_costs" / "cluster_sim_costs-engine_bench-2026-12-02.json"


def load_costs(path: Path | None = None) -> Costs:
    """The fit of ``path`` (default :data:`COSTS`).  Raises FileNotFoundError naming the command that writes one."""
    path = Path(path or COSTS)
    if not path.exists():
        raise FileNotFoundError(f"no cost model {path}: run benchmarks/cluster/cluster_sim_costs.py, or give --costs "
                                "FILE")
    f = json.loads(Path(path).read_text())["fit"]
    return Costs(**{k: f[k] for k in ("prefill_s", "prefill_per_token_s", "prefill_per_token_context_s",
                                      "decode_step_s", "decode_per_seq_s")}, source=str(Path(path).name))


# ---- trace -----------------------------------------------------------------------------------------------------
@dataclass
class Conv:
    """One conversation of the data: (user text, user piece ids, reply text, reply piece ids) per turn."""

    name: str
    turns: list[tuple[str, list[int], str, list[int]]]


def _tokenizer():
    from kvkeeper.text.tokenizer import load_tokenizer
    from kvkeeper.weights.sources import resolve_model_path

    return load_tokenizer(resolve_model_path(None), lazy=True)


def _cache_file(max_tokens: int) -> Path:
    key = hashlib.sha256()
    for p in (TOPICAL, MT_BENCH):
        key.update(p.read_bytes())
    key.update(f"{SYSTEM}|{max_tokens}|v1".encode())
    base = Path(os.environ.get("KVKEEPER_CACHE", Path.home() / ".cache" / "kvkeeper"))
    return base / "cluster_sim" / f"trace-{key.hexdigest()[:16]}.json"


def load_data(max_tokens: int) -> tuple[list[int], list[int], list[Conv]]:
    """(system piece ids, generation prompt ids, conversations), tokenized once and cached.

    A prompt is ``system + sum(user_i + reply_i) + user_k + generation prompt``: each piece is one message as
    SmolLM2's chat template renders it (``<|im_start|>role\\ncontent<|im_end|>\\n``), tokenized alone (the
    template's control tokens split the text, so the pieces' ids are the whole rendering's); a reply piece
    begins with the generation prompt, as the KV a turn computed does."""
    path = _cache_file(max_tokens)
    if path.exists():
        d = json.loads(path.read_text())
        return d["system"], d["gen"], [Conv(c["name"], [tuple(t) for t in c["turns"]]) for c in d["convs"]]
    tok = _tokenizer()

    def enc(text: str) -> list[int]:
        return list(tok.encode(text, add_special_tokens=False))

    gen = enc("<|im_start|>assistant\n")
    end = enc("<|im_end|>\n")
    system = enc(f"<|im_start|>system\n{SYSTEM}<|im_end|>\n")
    convs = []
    for line in TOPICAL.read_text().splitlines():
        if not line.strip():
            continue
        c = json.loads(line)
        lines = [t["text"] for t in c["turns"]]
        turns = []
        for u, r in zip(lines[0::2], lines[1::2]):
            rid = enc(r)[:max_tokens]
            rtext = tok.decode(rid)
            turns.append((u, enc(f"<|im_start|>user\n{u}<|im_end|>\n"), rtext, gen + rid + end))
        if turns:
            convs.append(Conv(c["id"], turns))
    for line in MT_BENCH.read_text().splitlines():
        if not line.strip():
            continue
        q = json.loads(line)
        turns = []
        for u in q["turns"]:
            uid = enc(f"<|im_start|>user\n{u}<|im_end|>\n")
            rid = enc(u)[:max_tokens]
            turns.append((u, uid, tok.decode(rid), gen + rid + end))
        convs.append(Conv(f"mt-{q['question_id']}", turns))
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"system": system, "gen": gen, "convs": [c.__dict__ for c in convs]}))
    return system, gen, convs


@dataclass
class Turn:
    conv: int
    index: int
    prompt: list[int]  # token ids
    reply: int  # tokens generated
    reply_ids: list[int]  # their ids (the reply and the template's end of turn, as the next prompt holds them)
    body: dict  # the chat request the text router hashes


@dataclass
class Instance:
    """A conversation of the trace: its data conversation, arrival (s) and think times between turns (s)."""

    id: int
    conv: Conv
    tag: list[int]
    tag_text: str
    arrival: float
    thinks: list[float]

    def turn(self, k: int, system: list[int], gen: list[int]) -> Turn:
        ids = list(system)
        messages = []
        for i, (u, uid, r, rid) in enumerate(self.conv.turns[:k + 1]):
            if i == 0:
                uid = uid[:3] + self.tag + uid[3:]  # after "<|im_start|>user\n"
                u = self.tag_text + u
            ids += uid
            messages.append({"role": "user", "content": u})
            if i < k:
                ids += rid
                messages.append({"role": "assistant", "content": r})
        reply = self.conv.turns[k][3][len(gen):]  # the reply's tokens (its generation prompt is the prompt's)
        return Turn(self.id, k, ids + gen, len(reply), reply, {"model": "sim", "messages": messages})


def build_trace(convs: list[Conv], n: int, rate: float, think_s: float, seed: int, tag_ids) -> list[Instance]:
    """``n`` conversations arriving as a Poisson process of ``rate`` per second (``tag_ids(i)``: ids of the
    "(Conversation i.) " tag a repeated draw gets)."""
    rng = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        t += rng.expovariate(rate)
        c = convs[i] if i < len(convs) else rng.choice(convs)
        tag, text = ([], "") if i < len(convs) else tag_ids(i)
        out.append(Instance(i, c, tag, text, t, [rng.expovariate(1.0 / think_s) if think_s > 0 else 0.0
                                                for _ in c.turns]))
    return out


def tag_maker(max_tokens: int):
    """ids of "(Conversation i.) " for any i, from cached pieces (digits tokenized one by one)."""
    path = _cache_file(max_tokens).with_suffix(".tags.json")
    if path.exists():
        pieces = json.loads(path.read_text())
    else:
        tok = _tokenizer()
        pieces = {s: list(tok.encode(s, add_special_tokens=False)) for s in ["(Conversation", ".) "] + list("0123456789")}
        pieces[" "] = list(tok.encode(" ", add_special_tokens=False))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(pieces))

    def tag(i: int):
        ids = pieces["(Conversation"] + pieces[" "]
        for ch in str(i):
            ids = ids + pieces[ch]
        return ids + pieces[".) "], f"(Conversation {i}.) "
    return tag


def full_blocks(ids: list[int], upto: int) -> list[int]:
    """Chained block hashes of the full blocks of ``ids[:upto]`` (as the pool registers them)."""
    from kvkeeper.kvcache.block_pool import block_hash

    out, parent = [], None
    for i in range(upto // BLOCK_SIZE):
        parent = block_hash(parent, NAMESPACE, ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
        out.append(parent)
    return out


def ideal_hit_rate(turns: list[Turn]) -> float:
    """One server with unbounded KV: every full block ever computed stays; a prompt reuses its leading held blocks
    (the last prompt token always computed).  Turns in conversation order (a turn follows its previous reply)."""
    held: set[int] = set()
    hit = total = 0
    for t in turns:
        hs = full_blocks(t.prompt, len(t.prompt) - 1)
        n = 0
        for h in hs:
            if h not in held:
                break
            n += 1
        hit += n * BLOCK_SIZE
        total += len(t.prompt)
        held.update(full_blocks(t.prompt + t.reply_ids, len(t.prompt) + t.reply - 1))
    return hit / total if total else 0.0


# ---- replicas --------------------------------------------------------------------------------------------------
@dataclass
class Req:
    turn: Turn
    arrival: float
    replica: str = ""
    blocks: list[int] = field(default_factory=list)
    cached: int = 0
    done: int = 0  # prompt tokens computed (cached ones included)
    generated: int = 0
    parents: list = field(default_factory=list)  # registered hashes, in order (None before the first)
    ttft: float | None = None


class Replica:
    """A replica: a real block pool, a waiting queue and a running batch (see the module docstring)."""

    def __init__(self, name: str, blocks: int, costs: Costs, max_num_seqs: int = 64, max_batched: int = 512):
        self.name = name
        self.capacity = blocks
        self.pool = BlockPool(min(blocks, GROW), BLOCK_SIZE)
        self.recorder = EventRecorder(BLOCK_SIZE)
        self.pool.attach_events(self.recorder)
        self.costs = costs
        self.max_num_seqs = max_num_seqs
        self.max_batched = max_batched
        self.waiting: deque[Req] = deque()
        self.running: list[Req] = []
        self.busy = False
        self.served = 0
        self.alive = True

    def load(self) -> ReplicaLoad:
        return ReplicaLoad(len(self.running), len(self.waiting), self.pool.num_used / self.capacity)

    def _grow(self, n: int) -> None:
        """Make ``n`` never-cached free blocks available while the pool is below its capacity.  A pool grown on
        demand acts as the full-size pool: allocation takes never-cached blocks first and evicts a cached one
        only when none is left, so eviction starts only once the capacity is reached."""
        pool = self.pool
        if len(pool._free_plain) >= n or pool.num_blocks >= self.capacity:
            return
        add = min(self.capacity - pool.num_blocks, max(n, GROW))
        for i in range(pool.num_blocks, pool.num_blocks + add):
            pool.blocks.append(Block(i))
            pool._free_plain[i] = None
        pool.num_blocks += add

    def queue_len(self) -> int:
        return len(self.running) + len(self.waiting)

    def _admit(self, r: Req) -> bool:
        ids = r.turn.prompt
        need = -(-(len(ids) + r.turn.reply) // BLOCK_SIZE)
        if need > self.capacity:
            raise ValueError(f"a request of {need} blocks cannot fit a pool of {self.capacity}: "
                             "raise --pool-fraction or lower --max-tokens")
        hits, parent = [], None
        for i in range((len(ids) - 1) // BLOCK_SIZE):
            bid, h = self.pool.lookup(parent, NAMESPACE, ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            if bid is None:
                break
            hits.append(bid)
            parent = h
        for b in hits:
            self.pool.incref(b)
        self._grow(need - len(hits))
        if need - len(hits) > self.pool.num_free:
            self.pool.free_all(hits)
            return False
        r.blocks = hits + self.pool.allocate(need - len(hits))
        r.cached = r.done = len(hits) * BLOCK_SIZE
        r.parents = [None] + [self.pool.blocks[b].hash for b in hits]
        return True

    def _register(self, r: Req, upto: int, ids: list[int]) -> None:
        """Register the full blocks of ``ids[:upto]`` not yet registered."""
        while len(r.parents) - 1 < upto // BLOCK_SIZE:
            i = len(r.parents) - 1
            h = self.pool.register(r.blocks[i], r.parents[-1], NAMESPACE, ids[i * BLOCK_SIZE:(i + 1) * BLOCK_SIZE])
            r.parents.append(h)

    def plan_step(self) -> tuple[float, list[tuple[Req, int]]] | None:
        """Admit what fits, choose this step's work; (seconds, prefill chunks) or None when idle."""
        budget = self.max_batched
        decoding = [r for r in self.running if r.done >= len(r.turn.prompt)]
        budget -= len(decoding)
        chunks = []
        for r in self.running:
            if r.done < len(r.turn.prompt) and budget > 0:
                n = min(budget, len(r.turn.prompt) - r.done)
                chunks.append((r, n))
                budget -= n
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            r = self.waiting[0]
            if not self._admit(r):
                break
            self.waiting.popleft()
            self.running.append(r)
            n = min(budget, len(r.turn.prompt) - r.done)
            chunks.append((r, n))
            budget -= n
        if not decoding and not chunks:
            return None
        return self.costs.step(len(decoding), [(n, r.done) for r, n in chunks]), chunks

    def finish_step(self, now: float, chunks: list[tuple[Req, int]]) -> list[Req]:
        """Apply a step's work at its end ``now``; returns the requests that finished."""
        prefilled = {id(r) for r, _ in chunks}
        finished = []
        for r in list(self.running):
            if id(r) in prefilled:
                continue
            r.generated += 1
            if r.generated >= r.turn.reply:
                finished.append(r)
        for r, n in chunks:
            r.done += n
            if r.done >= len(r.turn.prompt):
                r.ttft = now - r.arrival
                r.generated = 1
                self._register(r, len(r.turn.prompt), r.turn.prompt)
                if r.generated >= r.turn.reply:
                    finished.append(r)
            else:
                self._register(r, r.done, r.turn.prompt)
        for r in finished:
            self.running.remove(r)
            full = r.turn.prompt + r.turn.reply_ids
            self._register(r, len(full) - 1, full)
            self.pool.free_all(r.blocks)
            r.blocks = []
            self.served += 1
        return finished

    def lose(self) -> list[Req]:
        """The replica is gone: its requests (to route again) and its pool dropped."""
        self.alive = False
        out = list(self.running) + list(self.waiting)
        self.running, self.waiting = [], deque()
        return out


# ---- routers ---------------------------------------------------------------------------------------------------
class Router:
    """One of ROUTERS over the live replicas; ``observe`` is told each step's KV events and each routed prompt."""

    def __init__(self, kind: str, seed: int, exact_args: dict | None = None):
        if kind not in ROUTERS:
            raise ValueError(f"unknown router {kind!r}: choose from {', '.join(ROUTERS)}")
        self.kind = kind
        self.rng = random.Random(seed)
        self.policy = Policy(rng=random.Random(seed))
        self.index = KVIndex()
        self.exact = ExactRouter(self.index, NAMESPACE.digest, BLOCK_SIZE, rng=random.Random(seed), **(exact_args or {}))
        self.summaries: dict[str, PrefixSummary] = {}

    def route(self, reps: dict[str, Replica], t: Turn) -> str:
        live = [n for n, r in reps.items() if r.alive]
        if self.kind == "default":
            two = self.rng.sample(live, 2) if len(live) > 1 else live
            return min(two, key=lambda n: reps[n].queue_len())
        if self.kind == "ring":
            d = self.policy.choose([Candidate(n) for n in live], session_id=f"conv-{t.conv}")
            return pick(d, lambda n: reps[n].queue_len())
        if self.kind == "text":
            hs = prompt_block_hashes(t.body)
            cands = [Candidate(n, self.summaries.setdefault(n, PrefixSummary())._lru.keys()) for n in live]
            d = self.policy.choose(cands, prefix=hs)
            name = pick(d, lambda n: reps[n].queue_len())
            self.summaries[name].add(hs)
            return name
        d = self.exact.choose(live, {n: reps[n].load() for n in live}, t.prompt)
        return d.ranks[0][0]

    def events(self, rep: Replica) -> None:
        batch = rep.recorder.take()
        if batch is not None and self.kind == "exact":
            self.index.apply(rep.name, batch)

    def lost(self, name: str) -> None:
        self.index.remove_replica(name)
        self.summaries.pop(name, None)


# ---- the simulation --------------------------------------------------------------------------------------------
def pct(xs: list[float], q: float) -> float | None:
    if not xs:
        return None
    xs = sorted(xs)
    return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def simulate(kind: str, trace: list[Instance], system, gen, replicas: int, blocks: int, costs: Costs, seed: int,
             lose_at: float | None = None, closed_loop: bool = False) -> dict:
    """Run one router over the trace; the metrics of the module docstring (and, with ``lose_at``, the loss)."""
    reps = {f"r{i}": Replica(f"r{i}", blocks, costs) for i in range(replicas)}
    router = Router(kind, seed)
    ev: list = []  # (time, seq, kind, payload)
    seq = 0

    def push(t, what, payload):
        nonlocal seq
        seq += 1
        heapq.heappush(ev, (t, seq, what, payload))

    for inst in trace:
        push(inst.arrival, "turn", (inst, 0))
    if lose_at is not None:
        push(lose_at, "lose", None)
    done: list[Req] = []
    route_of: dict[int, str] = {}  # conversation -> replica of its last turn
    lost_name, lost_time = None, None

    def submit(now, r: Req):
        name = router.route(reps, r.turn)
        r.replica = name
        rep = reps[name]
        rep.waiting.append(r)
        if not rep.busy:
            start(now, rep)

    def start(now, rep: Replica):
        plan = rep.plan_step()
        router.events(rep)  # admission may evict (BlockRemoved)
        if plan is None:
            rep.busy = False
            return
        rep.busy = True
        push(now + plan[0], "step", (rep, plan[1]))

    while ev:
        now, _, what, payload = heapq.heappop(ev)
        if what == "turn":
            inst, k = payload
            t = inst.turn(k, system, gen)
            submit(now, Req(t, now))
        elif what == "step":
            rep, chunks = payload
            if not rep.alive:
                continue
            for r in rep.finish_step(now, chunks):
                done.append(r)
                route_of[r.turn.conv] = rep.name
                inst = trace[r.turn.conv]
                if r.turn.index + 1 < len(inst.conv.turns):
                    push(now + inst.thinks[r.turn.index], "turn", (inst, r.turn.index + 1))
            router.events(rep)
            start(now, rep)
        elif what == "lose":
            live = sorted((n for n, r in reps.items() if r.alive), key=lambda n: -reps[n].served)
            lost_name, lost_time = live[len(live) // 2], now
            orphans = reps[lost_name].lose()
            router.lost(lost_name)
            for r in orphans:
                r.blocks, r.cached, r.done, r.generated, r.parents = [], 0, 0, 0, []
                submit(now, r)
    prompt = sum(len(r.turn.prompt) for r in done)
    cached = sum(r.cached for r in done)
    ttfts = [r.ttft for r in done if r.ttft is not None]
    served = [r.served for r in reps.values()]
    mean = sum(served) / len(served)
    out = {"hit_rate": cached / prompt if prompt else 0.0, "ttft_p50_s": pct(ttfts, 0.5),
           "ttft_p99_s": pct(ttfts, 0.99), "load_max_over_mean": max(served) / mean if mean else None,
           "requests": len(done), "prompt_tokens": prompt, "cached_tokens": cached,
           "evictions": sum(r.pool.evictions for r in reps.values())}
    if closed_loop:
        late = [r for r in done if r.turn.index >= 2]
        out["ttft_p50_turn3plus_s"] = pct([r.ttft for r in late], 0.5)
        out["ttft_p99_turn3plus_s"] = pct([r.ttft for r in late], 0.99)
        out["hit_rate_turn2plus"] = (sum(r.cached for r in done if r.turn.index >= 1)
                                     / max(1, sum(len(r.turn.prompt) for r in done if r.turn.index >= 1)))
    if lost_name is not None:
        out["loss"] = loss_report(done, lost_name, lost_time)
    return out


def loss_report(done: list[Req], lost: str, at: float) -> dict:
    """After a replica is lost: which conversations changed replica, and the hit rate by turns since the loss of
    the conversations that had been on it (their first turn after the loss is turn 1)."""
    by_conv: dict[int, list[Req]] = {}
    for r in sorted(done, key=lambda r: r.arrival):
        by_conv.setdefault(r.turn.conv, []).append(r)
    moved_from_lost = moved_other = 0
    since: dict[int, list[Req]] = {}
    for rs in by_conv.values():
        before = [r for r in rs if r.arrival < at]
        after = [r for r in rs if r.arrival >= at]
        if not before or not after:
            continue
        was = before[-1].replica
        if was == lost:
            moved_from_lost += 1
            for i, r in enumerate(after[:4]):
                since.setdefault(i + 1, []).append(r)
        elif after[0].replica != was:
            moved_other += 1
    rate = {str(k): sum(r.cached for r in v) / max(1, sum(len(r.turn.prompt) for r in v)) for k, v in sorted(since.items())}
    return {"replica": lost, "at_s": at, "conversations_moved_from_lost": moved_from_lost,
            "conversations_moved_elsewhere": moved_other, "lost_conversations_hit_rate_by_turn_after": rate}


def working_set_blocks(trace: list[Instance], system, gen, rate: float, think_s: float) -> float:
    """Time-averaged KV blocks of the live conversations (Little's law; see the module docstring), all replicas."""
    per = []
    for inst in trace:
        s = 0.0
        for k in range(len(inst.conv.turns) - 1):  # between turns k and k+1 it holds turn k's prompt and reply
            t = inst.turn(k, system, gen)
            s += think_s * -(-(len(t.prompt) + t.reply) // BLOCK_SIZE)
        per.append(s)
    return rate * sum(per) / len(per)


VALIDATION_BENCH = RESULTS / "cluster_bench" / "cluster_bench-smollm2-135m-2026-12-01.json"
# (set-up name in cluster_bench, replicas, router); pools: its default 1 GiB (bf16 KV of SmolLM2: 23,040 bytes a
# token, 368,640 a block: 2,912 blocks) and its --pressure pool (its JSON's pressure.kv_blocks)
VALIDATION_SETUPS = [("1 replica", 1, "ring"), ("2 replicas, kvkeeper router", 2, "ring"),
                     ("2 replicas, Ray default router", 2, "default")]
DEFAULT_POOL_BLOCKS = (1 << 30) // (23040 * BLOCK_SIZE)
BOUNDS = {"hit_rate_abs": 0.05, "ttft_ratio": 2.0}  # |sim - real| hit rate; TTFT sim / real within [1/2, 2]


def validation_trace(convs: list[Conv], sessions: int, turns: int) -> list[Instance]:
    """cluster_bench's workload: ``sessions`` Topical-Chat conversations (the data's first ones, as its
    ``user_turns``) of ``turns`` turns, all started at once, each turn sent when the previous reply ends."""
    return [Instance(i, Conv(c.name, c.turns[:turns]), [], "", 0.0, [0.0] * turns)
            for i, c in enumerate(convs[:sessions])]


def validate(costs: Costs, bench: Path = VALIDATION_BENCH, seed: int = 0, sessions: int | None = None,
             turns: int | None = None) -> dict:
    """The simulator at cluster_bench's set-ups against its measured results (both pools); see BOUNDS."""
    real = json.loads(Path(bench).read_text())
    sessions, turns = sessions or real["sessions"], turns or real["turns"]
    system, gen, convs = load_data(real["max_tokens"])
    trace = validation_trace(convs, sessions, turns)
    out = {"bench": Path(bench).name, "sessions": sessions, "turns": turns, "max_tokens": real["max_tokens"],
           "bounds": BOUNDS, "costs": costs.__dict__, "pools": {}}
    pools = {"default": (DEFAULT_POOL_BLOCKS, real.get("setups", {}))}
    if real.get("pressure"):
        pools["pressure"] = (real["pressure"]["kv_blocks"], real["pressure"]["setups"])
    for pool, (blocks, measured) in pools.items():
        rows = {}
        for name, n, kind in VALIDATION_SETUPS:
            sim = simulate(kind, trace, system, gen, n, blocks, costs, seed, closed_loop=True)
            m = measured.get(name, {})
            row = {"blocks": blocks, "sim": {k: sim[k] for k in ("hit_rate", "hit_rate_turn2plus", "ttft_p50_turn3plus_s",
                                                                 "ttft_p99_turn3plus_s", "prompt_tokens")},
                   "real": {k: m.get(k) for k in ("hit_rate", "hit_rate_turn2plus", "ttft_p50_turn3plus_s",
                                                  "ttft_p99_turn3plus_s", "prompt_tokens")}}
            ok = {}
            if m:
                ok["hit_rate"] = abs(sim["hit_rate"] - m["hit_rate"]) <= BOUNDS["hit_rate_abs"]
                for k in ("ttft_p50_turn3plus_s", "ttft_p99_turn3plus_s"):
                    ratio = sim[k] / m[k]
                    row[k.replace("_s", "") + "_ratio"] = ratio
                    ok[k] = 1 / BOUNDS["ttft_ratio"] <= ratio <= BOUNDS["ttft_ratio"]
            row["within_bounds"] = ok
            rows[name] = row
        out["pools"][pool] = rows
    return out
