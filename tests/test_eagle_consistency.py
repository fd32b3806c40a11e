"""EAGLE train/inference consistency: what the engine's ``EagleDrafter``
proposes at every step must be what the training code's unrolled passes
(``eagle_passes``, which the held-out report scores) predict from the same
context. A mismatch between the two (features before vs after the final
norm, position ids, the token paired with each feature, the draft-vocabulary
mapping, the head's KV over the real pairs) makes the engine accept less
than the report promises; none of the drafter-only tests would see it."""

from __future__ import annotations

import pytest
import torch

from policies.table import Decision
from worker.reference.drafters.eagle import EagleDrafter
from worker.reference.engine.engine import Engine, static_decide
from worker.reference.heads.modules import EagleHead
from worker.reference.heads.store import HeadsBundle
from worker.reference.heads.train import eagle_passes
from worker.reference.models import tiny_llama


@pytest.mark.parametrize("depth", [1, 3])
def test_engine_drafts_equal_the_training_passes(depth):
    torch.set_num_threads(1)
    model, vocab = tiny_llama(seed=0)
    for p in model.parameters():
        p.requires_grad_(False)
    torch.manual_seed(3)
    vocab_map = torch.randperm(vocab)[: vocab // 2].sort().values  # a draft vocabulary that is not the identity
    bundle = HeadsBundle.build("eagle", EagleHead.config_from_target(model.config), vocab_map)
    for p in bundle.module.parameters():  # a random, non-trivial head
        torch.nn.init.normal_(p, std=0.2)
    bundle.module.eval()
    drafter = EagleDrafter(bundle, model, max_depth=4)
    log = []
    propose = drafter.propose

    def logged(contexts, decisions):
        trees = propose(contexts, decisions)
        log.extend((c.request_id, len(c.tokens) - 1, list(t.tokens)) for c, t in zip(contexts, trees))
        return trees

    drafter.propose = logged
    engine = Engine(model, drafter, static_decide(Decision.chain(depth)), max_batch=2)
    gen = torch.Generator().manual_seed(5)
    prompts = {f"r{i}": torch.randint(0, vocab, (n,), generator=gen).tolist() for i, n in enumerate((6, 9))}
    reqs = {rid: engine.submit(p, 16, request_id=rid) for rid, p in prompts.items()}
    engine.run()

    lm = model.get_output_embeddings().weight[vocab_map].float()
    emb = model.get_input_embeddings()
    checked = [0] * depth
    for rid, root, drafted in log:
        seq = prompts[rid] + reqs[rid].output
        assert root < len(seq) and len(drafted) == depth
        with torch.no_grad():
            feats = model.model(torch.tensor([seq])).last_hidden_state[0]  # what the engine hands the drafter
            # the context the drafter saw: real tokens up to the root, then its own drafts
            toks = torch.tensor([seq[: root + 1] + drafted])
            f = torch.zeros(1, toks.shape[1], feats.shape[1])
            f[0, : root + 1] = feats[: root + 1]  # features past the root must not matter (causal)
            outs = eagle_passes(bundle.module, emb, f, toks, depth)
        for j in range(1, depth + 1):
            # level j guesses x_{root+j} from pass j at pair root+j-2
            logits = outs[j - 1][0, root + j - 2] @ lm.T
            got = int((vocab_map == drafted[j - 1]).nonzero())
            assert logits[got] >= logits.max() - 1e-4, (rid, root, j, drafted, int(vocab_map[logits.argmax()]))
            checked[j - 1] += 1
    assert min(checked) >= 10
