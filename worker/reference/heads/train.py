"""Training Medusa and EAGLE heads by self-distillation, and the held-out report.

Labels come from the frozen target only: its greedy answers (``DistillSet``)
and its distribution at every position (``softmax(lm_head(feature))``,
restricted to the draft vocabulary). By default every position counts, the
prompt's too: the target's feature and distribution after a human-written
prefix are as much the target's own as after its answer, and on a CPU budget
the data is the scarce thing (``loss_on="answer"`` restricts it).

Medusa: head k on feature ``f_t`` is trained with soft cross-entropy against
the target's distribution for token ``t + 1 + k`` (its LM head on
``f_{t+k}``).

EAGLE: the head reads ``(f_t, x_{t+1})`` and predicts ``f_{t+1}``;
loss = smooth-L1 on the feature + ``cls_weight`` × soft cross-entropy of the
draft LM head on it. Inputs get noise (EAGLE's robustness trick) and, with
``unroll > 1``, the head is also trained on its own predicted features the
way it meets them while drafting (pass j reads pass j-1's prediction and
attends to real-feature keys up to the root and to the drafted path's keys
after it: the tree attention of inference, reproduced at training time).

The report (``evaluate``) gives per draft position, on held-out prompts,
top-1 / top-k accuracy against the target's greedy token and the mean
accepted length of a greedy chain of each depth.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict

import torch
import torch.nn.functional as F

from worker.reference.heads.data import DistillSet, draft_vocab
from worker.reference.heads.modules import EagleHead, init_layer_from_target
from worker.reference.heads.config import TrainConfig
from worker.reference.heads.store import HeadsBundle
from worker.reference.progress import ProgressBar

__all__ = ["TrainConfig", "evaluate", "train"]


def _lm_rows(model, vocab_map: torch.Tensor) -> torch.Tensor:
    """Frozen draft LM head: the target's LM head rows of the draft vocabulary (on the target's device)."""
    weight = model.get_output_embeddings().weight.detach()
    return weight[vocab_map.to(weight.device)].float()


def _device(model) -> torch.device:
    """Where the target is, and so where heads train: the features (kept on the host,
    ``DistillSet``) go there a batch at a time."""
    return next(model.parameters()).device


def _embed(model) -> torch.nn.Module:
    return model.get_input_embeddings()


# --------------------------------------------------------------------------
# Medusa
# --------------------------------------------------------------------------


def _medusa_samples(ds: DistillSet, idx: list[int], k: int, answer_only: bool = False):
    """Feature table + (position, label position per head) index tensors."""
    feats, pos, labels = [], [], []
    offset = 0
    for i in idx:
        f = ds.features[i]
        n, p = f.shape[0], ds.prompt_lens[i]
        feats.append(f)
        ts = torch.arange(max(p - 1, 0) if answer_only else 0, n, device="cpu")
        lab = ts[:, None] + torch.arange(1, k + 1, device="cpu")[None]  # head j (1-based) -> feature t + j
        lab = torch.where(lab <= n - 1, lab + offset, torch.full_like(lab, -1))
        pos.append(ts + offset)
        labels.append(lab)
        offset += n
    return torch.cat(feats), torch.cat(pos), torch.cat(labels)


def _train_medusa(bundle: HeadsBundle, model, ds: DistillSet, train_idx, cfg: TrainConfig, log) -> None:
    device = _device(model)
    heads = bundle.module.to(device)
    w = _lm_rows(model, bundle.vocab_map)
    table, pos, labels = _medusa_samples(ds, train_idx, cfg.num_heads, cfg.loss_on == "answer")  # host
    opt = torch.optim.AdamW(heads.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    steps = math.ceil(len(pos) / cfg.batch_positions) * cfg.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(steps, 1), pct_start=0.1)
    bar = ProgressBar(steps, "train medusa heads", enabled=log is not None)
    heads.train()
    for _ in range(cfg.epochs):
        perm = torch.randperm(len(pos), generator=gen, device="cpu")
        for start in range(0, len(pos), cfg.batch_positions):
            sel = perm[start : start + cfg.batch_positions]
            x = table[pos[sel]].to(device)  # [n, d]
            lab = labels[sel].to(device)  # [n, K]
            valid = lab >= 0
            with torch.no_grad():
                tgt = torch.softmax(table[labels[sel].clamp(min=0)].to(device) @ w.T, -1)  # [n, K, V]
            out = heads(x)  # [K, n, d]
            logp = torch.log_softmax(out @ w.T, -1).transpose(0, 1)  # [n, K, V]
            ce = -(tgt * logp).sum(-1)  # [n, K]
            loss = (ce * valid).sum() / valid.sum().clamp(min=1)
            opt.zero_grad()
            loss.backward()
            opt.step()
            sched.step()
            bar.update(1).show(loss=f"{loss.item():.3f}")
    bar.close()
    heads.eval()


# --------------------------------------------------------------------------
# EAGLE
# --------------------------------------------------------------------------


def _pad_batch(ds: DistillSet, idx: list[int], device: torch.device):
    """Features ``[B, L, d]``, tokens ``[B, L]``, lengths and prompt lengths ``[B]`` of the sequences
    ``idx``, right-padded on the host and copied to ``device`` once each."""
    width = max(ds.features[i].shape[0] for i in idx)
    d = ds.features[idx[0]].shape[1]
    feats = torch.zeros(len(idx), width, d, device="cpu")
    toks = torch.zeros(len(idx), width, dtype=torch.long, device="cpu")
    lens = torch.tensor([ds.features[i].shape[0] for i in idx], device="cpu")
    plens = torch.tensor([ds.prompt_lens[i] for i in idx], device="cpu")
    for r, i in enumerate(idx):
        n = ds.features[i].shape[0]
        feats[r, :n] = ds.features[i]
        toks[r, :n] = torch.tensor(ds.sequences[i], device="cpu")
    return tuple(x.to(device) for x in (feats, toks, lens, plens))


def _unroll_mask(length: int, j: int, device: torch.device | str = "cpu") -> torch.Tensor:
    """bool ``[L, j*L]`` on ``device``: pass-j query t sees pass-1 keys s <= t-j+1 and the
    pass-i key at s = t-j+i for 2 <= i <= j (its drafted ancestors and itself)."""
    t = torch.arange(length, device=device)
    blocks = [t[None, :] <= (t[:, None] - j + 1)]
    for i in range(2, j + 1):
        blocks.append(t[None, :] == (t[:, None] - j + i))
    mask = torch.cat(blocks, dim=1)
    mask[:, (j - 1) * length :] |= torch.eye(length, dtype=torch.bool, device=device)  # never an empty row
    return mask


def eagle_passes(head: EagleHead, embed, feats, toks, passes: int, noise: float = 0.0, gen=None):
    """Run ``passes`` unrolled passes over a padded batch.

    ``feats`` ``[B, L, d]``, ``toks`` ``[B, L]``. Pair t = (feature t, token
    t+1), t = 0..L-2. Returns a list: entry j-1 is pass j's output ``[B, L-1, d]``
    (the prediction of feature t+1 at depth j; entries t < j-1 are meaningless).
    """
    b, length, d = feats.shape
    n = length - 1
    emb = embed(toks[:, 1:]).float()  # [B, n, d]
    positions = torch.arange(n, device=feats.device)[None].expand(b, n)
    x_feat = feats[:, :-1]
    if noise:
        scale = feats.pow(2).mean().sqrt() * noise
        # Drawn on the host from the seeded generator (the same noise on any device), then moved.
        uniform = torch.rand(x_feat.shape, generator=gen, device="cpu").to(feats.device)
        x_feat = x_feat + (uniform * 2 - 1) * scale
    outs = []
    keys, vals = [], []
    for j in range(1, passes + 1):
        if j > 1:
            prev = outs[-1].detach()  # pass j-1's prediction of feature t, at pair t-1
            x_feat = torch.cat([feats[:, :1], prev[:, :-1]], dim=1)
        x = head.fc(torch.cat([x_feat, emb], dim=-1))
        if j == 1:
            out, k, v = head.layer(x, positions)
        else:
            mask = _unroll_mask(n, j, feats.device)[None, None]
            out, k, v = head.layer(x, positions, torch.cat(keys, 2), torch.cat(vals, 2), mask)
        keys.append(k)
        vals.append(v)
        outs.append(head.norm(out))
    return outs


def _eagle_loss(outs, feats, lens, plens, w, cls_weight, reg_weight=1.0, answer_only=False):
    b, length, _ = feats.shape
    n = length - 1
    target = feats[:, 1:]  # feature t+1
    t = torch.arange(n, device=feats.device)[None]
    base = t + 1 < lens[:, None]
    if answer_only:
        base = base & (t + 1 >= (plens[:, None] - 1))  # predict from the last prompt token on
    with torch.no_grad():
        tgt = torch.softmax(target @ w.T, -1)
    total = 0.0
    parts = []
    for j, out in enumerate(outs, start=1):
        valid = (base & (t >= j - 1)).float()
        denom = valid.sum().clamp(min=1)
        reg = (F.smooth_l1_loss(out, target, reduction="none").mean(-1) * valid).sum() / denom
        ce = (-(tgt * torch.log_softmax(out @ w.T, -1)).sum(-1) * valid).sum() / denom
        loss = reg_weight * reg + cls_weight * ce
        total = total + loss * (0.7 ** (j - 1))
        parts.append((reg.item(), ce.item()))
    return total, parts


def _train_eagle(bundle: HeadsBundle, model, ds: DistillSet, train_idx, cfg: TrainConfig, log) -> None:
    device = _device(model)
    head: EagleHead = bundle.module.to(device)
    w = _lm_rows(model, bundle.vocab_map)
    embed = _embed(model)
    for p in embed.parameters():
        p.requires_grad_(False)
    opt = torch.optim.AdamW(head.parameters(), lr=cfg.lr, weight_decay=cfg.weight_decay)
    gen = torch.Generator().manual_seed(cfg.seed)
    order = sorted(train_idx, key=lambda i: ds.features[i].shape[0])
    batches = [order[s : s + cfg.batch_sequences] for s in range(0, len(order), cfg.batch_sequences)]
    steps = len(batches) * cfg.epochs
    sched = torch.optim.lr_scheduler.OneCycleLR(opt, max_lr=cfg.lr, total_steps=max(steps, 1), pct_start=0.1)
    bar = ProgressBar(steps, "train eagle head", enabled=log is not None)
    head.train()
    for _ in range(cfg.epochs):
        for bi in torch.randperm(len(batches), generator=gen, device="cpu").tolist():
            feats, toks, lens, plens = _pad_batch(ds, batches[bi], device)
            outs = eagle_passes(head, embed, feats, toks, cfg.unroll, cfg.noise, gen)
            loss, parts = _eagle_loss(outs, feats, lens, plens, w, cfg.cls_weight, cfg.reg_weight,
                                      cfg.loss_on == "answer")
            opt.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(head.parameters(), 1.0)
            opt.step()
            sched.step()
            bar.update(1).show(reg=f"{parts[0][0]:.3f}", ce=f"{parts[0][1]:.3f}")
    bar.close()
    head.eval()


# --------------------------------------------------------------------------
# report
# --------------------------------------------------------------------------


@torch.no_grad()
def evaluate(bundle: HeadsBundle, model, ds: DistillSet, idx: list[int], depth: int | None = None,
             topk: int = 5) -> dict:
    """Held-out accuracy per draft position and mean accepted chain length.

    Position j (1-based) is the j-th draft token after the root. For a root
    at sequence position r (features known up to r-1), the position-j guess
    is Medusa head j on ``f_{r-1}`` or EAGLE pass j at pair ``r+j-2``; it is
    right when it equals the target's greedy token ``x_{r+j}``. Only roots
    in the answer region with ``x_{r+j}`` inside the sequence count.
    """
    depth = depth or (bundle.config.get("num_heads") if bundle.kind == "medusa" else 5)
    # The heads guess on the target's device; the counting runs on the host.
    device = _device(model)
    w = _lm_rows(model, bundle.vocab_map)
    vmap = bundle.vocab_map.cpu()
    top1 = torch.zeros(depth, device="cpu")
    topn = torch.zeros(depth, device="cpu")
    count = torch.zeros(depth, device="cpu")
    chain = torch.zeros(depth, device="cpu")  # Σ accepted length of chains of depth 1..D
    roots = 0
    in_vocab = 0
    answer_tokens = 0
    vocab_set = torch.zeros(int(vmap.max()) + 1 if len(vmap) else 1, dtype=torch.bool, device="cpu")
    vocab_set[vmap] = True
    bundle.module.to(device)
    for i in idx:
        seq = torch.tensor(ds.sequences[i], device="cpu")
        f = ds.features[i].to(device)
        n, p = f.shape[0], ds.prompt_lens[i]
        ans = seq[p:]
        answer_tokens += len(ans)
        in_vocab += int(vocab_set[ans.clamp(max=len(vocab_set) - 1)].logical_and(ans < len(vocab_set)).sum())
        # guesses[j][r] = top-k draft ids for x_{r+j}, for roots r = p .. n-1 (root r = x_r committed)
        if bundle.kind == "medusa":
            out = bundle.module(f)  # [K, n, d]; head j on f_t guesses x_{t+1+j}
            logits = out[:depth] @ w.T  # [D, n, V]
            guess = [logits[j - 1, :] for j in range(1, depth + 1)]  # index t = r-1
            shift = [-1] * depth
        else:
            outs = eagle_passes(bundle.module, _embed(model), f[None], seq.to(device)[None], depth)
            guess = [o[0] @ w.T for o in outs]  # pass j at pair t guesses x_{t+2}; t = r+j-2
            shift = [j - 2 for j in range(1, depth + 1)]
        tops = [vmap[g.topk(min(topk, g.shape[-1]), -1).indices.cpu()] for g in guess]  # token ids, host
        for r in range(max(p, 1), n):
            ok_chain = True
            roots += 1
            for j in range(1, depth + 1):
                t = r + shift[j - 1]
                if r + j >= n or t < 0 or t >= tops[j - 1].shape[0]:
                    ok_chain = False
                    break
                target = int(seq[r + j])
                cand = tops[j - 1][t]
                hit1 = int(cand[0]) == target
                count[j - 1] += 1
                top1[j - 1] += hit1
                topn[j - 1] += bool((cand == target).any())
                ok_chain = ok_chain and hit1
                if ok_chain:
                    chain[j - 1:] += 1  # a chain of depth >= j accepts this position
    positions = [
        {"position": j + 1, "top1": round(float(top1[j] / count[j]), 4) if count[j] else None,
         f"top{topk}": round(float(topn[j] / count[j]), 4) if count[j] else None, "n": int(count[j])}
        for j in range(depth)
    ]
    return {
        "held_out_sequences": len(idx),
        "positions": positions,
        "mean_accepted_chain": {f"d{j + 1}": round(float(chain[j] / max(roots, 1)), 4) for j in range(depth)},
        "draft_vocab": int(len(vmap)),
        "draft_vocab_coverage": round(in_vocab / max(answer_tokens, 1), 4),
    }


# --------------------------------------------------------------------------
# entry point
# --------------------------------------------------------------------------


def train(model, ds: DistillSet, cfg: TrainConfig, log=print) -> HeadsBundle:
    """Train heads of ``cfg.kind`` on ``ds``; returns a sealed bundle with its report."""
    torch.manual_seed(cfg.seed)
    t0 = time.perf_counter()
    train_idx, test_idx = ds.split(cfg.held_out)
    eos = getattr(model.generation_config, "eos_token_id", None)
    always = tuple([eos] if isinstance(eos, int) else (eos or ()))
    vocab_size = model.get_output_embeddings().weight.shape[0]
    vocab_map = draft_vocab(ds, cfg.draft_vocab, vocab_size, always, train_idx)
    config = model.config
    hidden = config.hidden_size
    if cfg.kind == "medusa":
        bundle = HeadsBundle.build("medusa", {"hidden": hidden, "num_heads": cfg.num_heads}, vocab_map)
        trainer = _train_medusa
    elif cfg.kind == "eagle":
        sizes = EagleHead.config_from_target(config)
        bundle = HeadsBundle.build("eagle", sizes, vocab_map)
        base = getattr(model, model.base_model_prefix)
        with torch.no_grad():
            bundle.module.norm.weight.copy_(base.norm.weight.detach().float())
        if cfg.init_from_target:
            init_layer_from_target(bundle.module, base.layers[-1])
        trainer = _train_eagle
    else:
        raise ValueError(f"unknown heads kind {cfg.kind!r}")
    with torch.enable_grad():
        trainer(bundle, model, ds, train_idx, cfg, log)
    report = evaluate(bundle, model, ds, test_idx, depth=cfg.num_heads if cfg.kind == "medusa" else max(
        cfg.num_heads, 5), topk=cfg.topk)
    bundle.meta = {
        "model_key": ds.model_key,
        "data_hash": ds.data_hash,
        "train_sequences": len(train_idx),
        "held_out_sequences": len(test_idx),
        "train_tokens": sum(len(ds.sequences[i]) for i in train_idx),
        "max_new_tokens": ds.max_new_tokens,
        "train_config": asdict(cfg),
        "train_seconds": round(time.perf_counter() - t0, 1),
        "report": report,
        "trained_context_len": max(len(s) for s in ds.sequences),
    }
    bundle.seal()
    return bundle
