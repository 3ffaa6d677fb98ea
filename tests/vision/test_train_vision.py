"""`train/vision.py` (issue 20, Build 3): SigLIP's loss, captioning documents and rows, the frozen-ViT rule,
caption matching, and a two-step run of the stages on shards written here (no packages needed)."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from dsv41 import load_config
from dsv41.config import ConfigError
from dsv41.model.transformer import Transformer
from dsv41.train.tokenizer import BOS_ID, EOS_ID, load_tokenizer
from dsv41.train.vision import (
    SigLIP,
    VisionTrainConfig,
    caption_doc,
    collate_rows,
    config_from_overrides,
    match_class,
    pack_rows,
    run_stage,
    set_vit_trainable,
)

TINY_VIT = dict(vision_n_layers=1, vision_dim=32, vision_n_heads=2, vision_inter_dim=32)


def test_siglip_loss_equals_the_pairwise_formula():
    torch.manual_seed(0)
    tc = VisionTrainConfig(text_width=32, text_layers=1, embed_dim=16)
    model = SigLIP(load_config("tiny-vl").replace(**TINY_VIT), 300, tc)
    with torch.no_grad():
        model.logit_scale.fill_(math.log(3.0))
        model.logit_bias.fill_(-1.5)
    img = torch.nn.functional.normalize(torch.randn(6, 16), dim=-1)
    txt = torch.nn.functional.normalize(torch.randn(6, 16), dim=-1)
    positive = torch.eye(6, dtype=torch.bool)
    positive[0, 3] = positive[3, 0] = True  # two images of one class: positives, not negatives
    want = 0.0
    for i in range(6):
        for j in range(6):
            z = 1.0 if positive[i, j] else -1.0
            logit = 3.0 * float(img[i] @ txt[j]) - 1.5
            want += math.log1p(math.exp(-z * logit))
    got = float(model.loss(img, txt, positive).detach())
    assert abs(got - want / 6) < 1e-5, (got, want / 6)


def test_caption_documents_target_only_the_caption_and_rows_keep_documents_apart():
    tok = load_tokenizer(VisionTrainConfig().tokenizer)
    toks, target = caption_doc(tok, 8, "ankle boot", chat=False, image_token_id=3)
    body = tok.encode("ankle boot")
    assert toks == [BOS_ID] + [3] * 8 + body + [EOS_ID]
    assert target == [False] * 9 + [True] * (len(body) + 1)
    chat, chat_target = caption_doc(tok, 8, "bag", chat=True, image_token_id=3)
    assert chat.count(3) == 8 and sum(chat_target) == len(tok.encode("bag")) + 1
    docs = [(toks, target, "a"), (chat, chat_target, "b"), (toks, target, "c")]
    rows = pack_rows(docs, seq_len=40)
    batch = collate_rows(rows, 40, 3)
    fits_two = len(toks) + len(chat) <= 41
    assert [r["images"] for r in rows] == ([["a", "b"], ["c"]] if fits_two else [["a"], ["b"], ["c"]])
    # a target is predicted only inside its own document, and only caption tokens are targets
    for r in range(batch["tokens"].shape[0]):
        for t in range(40):
            if batch["loss_mask"][r, t]:
                assert batch["doc_ids"][r, t] != 0 and batch["targets"][r, t] != 3
    assert int(batch["image_mask"].sum()) == 8 * len(docs)
    assert int(batch["loss_mask"].sum()) == sum(sum(t) for _, t, _ in docs)


def test_the_frozen_vit_keeps_its_last_norm_trainable():
    model = Transformer(load_config("tiny-vl").replace(**TINY_VIT))
    set_vit_trainable(model, False)
    trainable = {n for n, p in model.vision.named_parameters() if p.requires_grad}
    assert trainable == {"norm.weight"}
    assert all(p.requires_grad for p in model.aligner.parameters())  # the projector always trains
    set_vit_trainable(model, True)
    assert all(p.requires_grad for p in model.vision.parameters())


def test_match_class_prefers_the_longest_name():
    names = ["shirt", "t-shirt", "bag", "ankle boot"]
    assert match_class("a photo of a t-shirt", names) == "t-shirt"
    assert match_class("shirt with", names) == "shirt"
    assert match_class("ankle boot", names) == "ankle boot"
    assert match_class("boot", names) is None


def test_bad_options_are_config_errors():
    with pytest.raises(ConfigError, match="unknown key"):
        config_from_overrides({"stepz": "3"})
    with pytest.raises(ConfigError, match="positive"):
        config_from_overrides({"steps": "0"})
    with pytest.raises(ConfigError, match="mix"):
        config_from_overrides({"mix": "fashion"})


def _shards(folder, rng):
    """Two tiny sources in the builder's format: 28² grey 'fashion' and 56² RGB 'emoji'."""
    for source, shape, names in (("fashion", (28, 28), ["t-shirt", "bag"]), ("emoji", (56, 56, 3), ["cat", "dog"])):
        for split, n in (("train", 12), ("test", 4)):
            labels = rng.integers(0, 2, n)
            pixels = rng.integers(0, 256, (n, *shape), dtype=np.uint8)
            np.savez_compressed(folder / f"{source}-{split}.npz", pixels=pixels, label=labels)
            (folder / f"{source}-{split}.jsonl").write_text("".join(
                json.dumps({"caption": names[y], "name": names[y], "label": int(y)}) + "\n" for y in labels))


@pytest.mark.slow  # two stages, two steps each, with their evaluations (~30 s alone)
def test_the_stages_run_end_to_end_on_tiny_shards(tmp_path, monkeypatch):
    _shards(tmp_path, np.random.default_rng(0))
    import dsv41.train.vision as tv

    original = VisionTrainConfig.model_config
    monkeypatch.setattr(tv.VisionTrainConfig, "model_config", lambda self: original(self).replace(**TINY_VIT))
    tc = VisionTrainConfig(data=str(tmp_path), out=str(tmp_path / "run"), steps=2, batch_size=4, seq_len=24,
                           eval_every=100, eval_images=4, text_width=32, text_layers=1, embed_dim=16, progress=False,
                           mix="fashion:1,emoji:1", caption_mix="fashion:1,emoji:1", keep_lm=True)
    s1 = run_stage("siglip", tc)
    assert 0 <= s1["fashion_zero_shot_acc"] <= 1 and s1["fashion_n"] == 4 and s1["emoji_n"] == 4
    s2 = run_stage("caption", tc)
    assert {"caption_match", "text_only_match", "chance"} <= set(s2)
    for stage in ("siglip", "caption"):
        records = [json.loads(line) for line in (tmp_path / "run" / stage / "metrics.jsonl").read_text().splitlines()]
        assert [r["step"] for r in records if r["type"] == "train"] == [1, 2]
        assert (tmp_path / "run" / stage / "curves.png").stat().st_size > 1000
    assert (tmp_path / "run" / "caption" / "model" / "config.json").exists()
    with pytest.raises(ConfigError, match="unknown stage"):
        run_stage("finetune", tc)
