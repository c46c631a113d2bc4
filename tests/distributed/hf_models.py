"""Hugging Face ``transformers`` models from tiny configs (nothing is downloaded) inside a LightningModule.

GPT-2 (tied input/output embeddings, ``Conv1D`` weights), BERT masked LM (tied decoder and its bias), a
Llama-style causal LM (RMSNorm, rotary embeddings, SwiGLU, grouped-query attention), T5 (an encoder-decoder
whose one embedding is shared by encoder, decoder and head, with ``use_cache`` on by default and a relative
position bias computed in the first block and used by all), Mixtral (a mixture of experts: 4 experts in one
fused 3-D parameter per layer, 2 routed per token, so an expert a rank's tokens skip gets a zero gradient
there), ViT (image classification from patches) and CLIP (a text and a vision tower trained contrastively, with a
learned 0-dim temperature ``logit_scale``, which FSDP2 cannot shard). Dropout is off so a single process can replay the ranks'
arithmetic exactly.

The Llama config draws its weights with ``initializer_range=0.2`` (the library's default is 0.02). At 0.02 the
first layer's attention is nearly uniform and its q/k projections get gradients of ~4e-4, near bf16's
rounding of the other terms; with transformers 5.24 the ranks and the single-process emulation then ended
1.4e-5 apart on exactly those two matrices (every other parameter within 1e-8, and 0 at world size 1),
since AdamW normalises each element. At 0.2 every parameter agrees within 1.2e-7.
"""

from __future__ import annotations

import lightning as L
import torch
import torch.nn.functional as F

from tests.distributed import models

VOCAB, LENGTH, MASK_ID = 64, 12, 63
IMAGE, CLASSES = 8, 5  # ViT: 3 x 8 x 8 pixels (LENGTH x 16 values), 4 x 4 patches


def tiny_config(kind: str):
    from transformers import BertConfig, CLIPConfig, GPT2Config, LlamaConfig, MixtralConfig, T5Config, ViTConfig

    if kind == "gpt2":
        return GPT2Config(
            vocab_size=VOCAB,
            n_positions=LENGTH,
            n_embd=32,
            n_layer=2,
            n_head=2,
            resid_pdrop=0.0,
            embd_pdrop=0.0,
            attn_pdrop=0.0,
        )
    if kind == "bert":
        return BertConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            max_position_embeddings=LENGTH,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    if kind == "llama":
        return LlamaConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            max_position_embeddings=LENGTH,
            initializer_range=0.2,
        )
    if kind == "t5":
        return T5Config(vocab_size=VOCAB, d_model=32, d_kv=8, d_ff=64, num_layers=2, num_heads=4, dropout_rate=0.0)
    if kind == "mixtral":
        return MixtralConfig(
            vocab_size=VOCAB,
            hidden_size=32,
            intermediate_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            num_local_experts=4,
            num_experts_per_tok=2,
            max_position_embeddings=LENGTH,
            initializer_range=0.2,
        )
    if kind == "vit":
        return ViTConfig(
            image_size=IMAGE,
            patch_size=4,
            num_channels=3,
            hidden_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            intermediate_size=64,
            num_labels=CLASSES,
            hidden_dropout_prob=0.0,
            attention_probs_dropout_prob=0.0,
        )
    if kind == "clip":
        return CLIPConfig(
            text_config=dict(
                vocab_size=VOCAB,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
                max_position_embeddings=LENGTH,
                eos_token_id=MASK_ID,
            ),
            vision_config=dict(
                image_size=IMAGE,
                patch_size=4,
                hidden_size=32,
                intermediate_size=64,
                num_hidden_layers=2,
                num_attention_heads=2,
            ),
            projection_dim=16,
        )
    raise ValueError(kind)


def model_class(kind: str):
    import transformers

    return {
        "gpt2": transformers.GPT2LMHeadModel,
        "bert": transformers.BertForMaskedLM,
        "llama": transformers.LlamaForCausalLM,
        "t5": transformers.T5ForConditionalGeneration,
        "mixtral": transformers.MixtralForCausalLM,
        "vit": transformers.ViTForImageClassification,
        "clip": transformers.CLIPModel,
    }[kind]


def block_class(kind: str):
    """The library's own transformer block, for activation checkpointing."""
    from transformers.models.bert.modeling_bert import BertLayer
    from transformers.models.clip.modeling_clip import CLIPEncoderLayer
    from transformers.models.gpt2.modeling_gpt2 import GPT2Block
    from transformers.models.llama.modeling_llama import LlamaDecoderLayer
    from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer
    from transformers.models.t5.modeling_t5 import T5Block
    from transformers.models.vit.modeling_vit import ViTLayer

    return {
        "gpt2": GPT2Block,
        "bert": BertLayer,
        "llama": LlamaDecoderLayer,
        "t5": T5Block,
        "mixtral": MixtralDecoderLayer,
        "vit": ViTLayer,
        "clip": CLIPEncoderLayer,
    }[kind]


def pixels(tokens: torch.Tensor) -> torch.Tensor:
    """A (B, 3, IMAGE, IMAGE) image that is a pure function of a (B, LENGTH) token window (every replay sees the
    same pixels): each token spreads over 16 values of different frequency."""
    waves = torch.sin(tokens[..., None].float() * torch.arange(1, 17) / 7.0)  # (B, LENGTH, 16)
    return waves.reshape(tokens.shape[0], 3, IMAGE, IMAGE)


class HFLightningModule(L.LightningModule):
    """A causal or masked LM step on token windows; ``_loss`` is what the single-process references call."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind = kind
        self.model = model_class(kind)(tiny_config(kind))

    def _loss(self, batch) -> torch.Tensor:
        x, y = batch  # (B, T) tokens and the next tokens
        if self.kind == "bert":
            # A fixed 1-in-4 mask, a pure function of the batch so every replay masks the same positions.
            masked = (x + torch.arange(x.shape[1])) % 4 == 0
            logits = self.model(input_ids=x.masked_fill(masked, MASK_ID)).logits
            labels = torch.where(masked, x, torch.full_like(x, -100))
        elif self.kind == "clip":  # each rank's batch of (text, image) pairs against one another
            text = torch.cat([x[:, :-1], torch.full_like(x[:, -1:], MASK_ID)], dim=1)  # pooled at the closing token
            return self.model(input_ids=text, pixel_values=pixels(x), return_loss=True).loss
        elif self.kind == "vit":
            logits = self.model(pixel_values=pixels(x)).logits
            return F.cross_entropy(logits.float(), x[:, 0] % CLASSES)
        elif self.kind == "t5":
            logits = self.model(input_ids=x, decoder_input_ids=x).logits  # the decoder predicts the next token
            labels = y
        else:
            logits = self.model(input_ids=x).logits
            labels = y
        return F.cross_entropy(logits.float().reshape(-1, VOCAB), labels.reshape(-1), ignore_index=-100)

    def training_step(self, batch, batch_idx):
        loss = self._loss(batch)
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        # CLIP's text attention is causal, and its key biases (to which attention is blind) get rounding noise for a
        # gradient, in the order each run sums it; AdamW's default eps steps that noise at full size (SGD agrees with
        # the reference within 2.4e-7), a larger one at a hundredth of it.
        eps = 1e-6 if self.kind == "clip" else 1e-8
        opt = torch.optim.AdamW(models.param_groups(self), lr=3e-3, betas=(0.9, 0.95), eps=eps)
        sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: min(1.0, (step + 1) / 3))
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}
