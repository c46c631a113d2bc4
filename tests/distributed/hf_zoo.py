"""More Hugging Face architectures from tiny configs (nothing is downloaded), each with the trap it carries, trained
through their own ``labels`` losses: the breadth check beside ``hf_models.py``'s exactness against plain PyTorch.

Qwen2-MoE (a shared expert behind a sigmoid gate beside routed ones), OLMoE and DeepSeek-V3 (routed experts a rank's
tokens may skip; DeepSeek's low-rank attention and a dense first layer), Jamba (Mamba and attention layers with
experts every other layer), Mamba (a selective scan, no attention), Gemma-2 (norms holding ``1 + weight``, logit
soft-capping, sliding windows), Phi-3 (fused qkv and gate-up projections), BART and Whisper (encoder-decoders: tied
embeddings, a convolutional audio front end and fixed sinusoidal positions), Wav2Vec2 (a convolutional feature
encoder, a positional convolution under ``parametrizations.weight_norm``, a CTC loss), Switch Transformers (top-1 routing with
capacity, so tokens are dropped), DeBERTa-v2 (disentangled relative attention), Swin (shifted windows, relative
position tables), ConvNeXt (depthwise convolutions, channels-last LayerNorm), ALBERT (one layer group run three times a
forward: its gradients sum over the uses, and a checkpointed group recomputes each), LLaVA (a CLIP vision tower and a
projector whose features replace the image tokens of a Llama's input by ``masked_scatter``) and Reformer (reversible
layers: its backward re-runs each layer's forward and calls ``torch.autograd.backward`` inside the outer backward, so
DDP's reducer refuses it and its reference is plain PyTorch: ``WITHOUT_DDP``); GPT-OSS (attention sinks, experts fused
into 3-D parameters with biases), Gemma-3n (AltUp's parallel streams, per-layer input embeddings, layers reading the
key/value states of earlier layers), Qwen3-Next (gated delta-rule linear attention beside full attention, experts),
Zamba (one attention block shared by the hybrid layers), ResNet and PatchTST (BatchNorm inside the checkpointed blocks,
whose recomputation must not count a batch twice; PatchTST forecasts real-valued series) and Funnel Transformer (its
encoder's layers in a list of lists, pooled between blocks); SqueezeBERT (grouped 1-D convolutions, and an encoder
that runs its layers as ``layer.forward(...)``, skipping the hooks stage 3 gathers a unit in), ConvNeXt-V2 (global
response normalization: parameters of shape 1 x 1 x 1 x C, a single row to shard), RWKV (time-mixing vectors of
shape 1 x 1 x C, a recurrence instead of attention), XLNet (two-stream relative attention, parameters of shape
1 x 1 x C beside 3-D ones), FNet (Fourier transforms in place of attention) and ViT-MAE (random masking each forward,
a decoder on the kept patches, no labels).
"""

from __future__ import annotations

import lightning as L
import torch

VOCAB, LENGTH = 64, 16
VISION = ("swin", "convnext", "resnet", "convnextv2")
KINDS = (
    "qwen2_moe",
    "olmoe",
    "deepseek_v3",
    "jamba",
    "mamba",
    "gemma2",
    "phi3",
    "bart",
    "whisper",
    "wav2vec2",
    "switch",
    "deberta",
    "swin",
    "convnext",
    "albert",
    "llava",
    "reformer",
    "gpt_oss",
    "gemma3n",
    "qwen3_next",
    "zamba",
    "resnet",
    "patchtst",
    "funnel",
    "squeezebert",
    "convnextv2",
    "rwkv",
    "xlnet",
    "fnet",
    "vit_mae",
)
#: Architectures DDP cannot train ("Expected to mark a variable ready only once", with or without a static graph):
#: their reference is the same steps in one process (``worker_zoo.plain_reference``).
WITHOUT_DDP = ("reformer",)
IMAGE_TOKENS = 17  # LLaVA: the 16 patches and the class token of a 16 x 16 image, all kept ("full")


def build(kind: str) -> torch.nn.Module:
    import transformers as T

    decoder = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=LENGTH,
        initializer_range=0.2,
    )
    if kind == "qwen2_moe":
        return T.Qwen2MoeForCausalLM(
            T.Qwen2MoeConfig(
                **decoder,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=32,
                num_experts=4,
                num_experts_per_tok=2,
            )
        )
    if kind == "olmoe":
        return T.OlmoeForCausalLM(
            T.OlmoeConfig(**{**decoder, "intermediate_size": 16}, num_experts=4, num_experts_per_tok=2)
        )
    if kind == "deepseek_v3":
        return T.DeepseekV3ForCausalLM(
            T.DeepseekV3Config(
                **{**decoder, "num_key_value_heads": 4},
                moe_intermediate_size=16,
                first_k_dense_replace=1,
                n_routed_experts=4,
                num_experts_per_tok=2,
                n_group=1,
                topk_group=1,
                n_shared_experts=1,
                q_lora_rank=16,
                kv_lora_rank=16,
                qk_rope_head_dim=4,
                qk_nope_head_dim=4,
                v_head_dim=8,
                rope_scaling=None,
            )
        )
    if kind == "jamba":
        return T.JambaForCausalLM(
            T.JambaConfig(
                **{k: v for k, v in decoder.items() if k != "initializer_range"},
                num_experts=2,
                num_experts_per_tok=1,
                expert_layer_period=2,
                expert_layer_offset=1,
                attn_layer_period=2,
                attn_layer_offset=1,
                mamba_d_state=4,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=4,
                use_mamba_kernels=False,
            )
        )
    if kind == "mamba":
        return T.MambaForCausalLM(
            T.MambaConfig(vocab_size=VOCAB, hidden_size=32, state_size=4, num_hidden_layers=2, expand=2, conv_kernel=4)
        )
    if kind == "gemma2":
        return T.Gemma2ForCausalLM(T.Gemma2Config(**decoder, head_dim=8, sliding_window=8))
    if kind == "phi3":
        return T.Phi3ForCausalLM(T.Phi3Config(**decoder, pad_token_id=0))
    if kind == "bart":
        return T.BartForConditionalGeneration(
            T.BartConfig(
                vocab_size=VOCAB,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_position_embeddings=LENGTH + 2,
                dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
            )
        )
    if kind == "whisper":
        return T.WhisperForConditionalGeneration(
            T.WhisperConfig(
                vocab_size=VOCAB,
                num_mel_bins=8,
                d_model=32,
                encoder_layers=2,
                decoder_layers=2,
                encoder_attention_heads=2,
                decoder_attention_heads=2,
                encoder_ffn_dim=64,
                decoder_ffn_dim=64,
                max_source_positions=LENGTH // 2,
                max_target_positions=LENGTH,
                pad_token_id=0,
                decoder_start_token_id=1,
                eos_token_id=2,
                bos_token_id=1,
                dropout=0.0,
            )
        )
    if kind == "wav2vec2":
        return T.Wav2Vec2ForCTC(
            T.Wav2Vec2Config(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                conv_dim=(16, 16),
                conv_stride=(2, 2),
                conv_kernel=(3, 3),
                num_conv_pos_embeddings=4,
                num_conv_pos_embedding_groups=2,
                mask_time_prob=0.0,
                hidden_dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                feat_proj_dropout=0.0,
                layerdrop=0.0,
                pad_token_id=0,
                ctc_loss_reduction="mean",
            )
        )
    if kind == "switch":
        return T.SwitchTransformersForConditionalGeneration(
            T.SwitchTransformersConfig(
                vocab_size=VOCAB,
                d_model=32,
                d_kv=8,
                d_ff=64,
                num_layers=2,
                num_decoder_layers=2,
                num_heads=4,
                num_experts=4,
                expert_capacity=8,
                encoder_sparse_step=1,
                decoder_sparse_step=1,
                dropout_rate=0.0,
                router_jitter_noise=0.0,
                decoder_start_token_id=0,
                pad_token_id=0,
            )
        )
    if kind == "deberta":
        return T.DebertaV2ForMaskedLM(
            T.DebertaV2Config(
                vocab_size=VOCAB,
                hidden_size=32,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=LENGTH,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                relative_attention=True,
                pos_att_type=["p2c", "c2p"],
                position_buckets=8,
            )
        )
    if kind == "swin":
        return T.SwinForImageClassification(
            T.SwinConfig(
                image_size=16,
                patch_size=2,
                num_channels=3,
                embed_dim=8,
                depths=[1, 1],
                num_heads=[2, 2],
                window_size=4,
                num_labels=5,
            )
        )
    if kind == "convnext":
        return T.ConvNextForImageClassification(
            T.ConvNextConfig(
                num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5, patch_size=2
            )
        )
    if kind == "albert":
        return T.AlbertForMaskedLM(
            T.AlbertConfig(
                vocab_size=VOCAB,
                embedding_size=16,
                hidden_size=32,
                num_hidden_layers=3,
                num_hidden_groups=1,
                num_attention_heads=2,
                intermediate_size=64,
                max_position_embeddings=LENGTH,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
            )
        )
    if kind == "llava":
        vision = T.CLIPVisionConfig(
            hidden_size=16,
            intermediate_size=32,
            num_hidden_layers=2,
            num_attention_heads=2,
            image_size=16,
            patch_size=4,
        )
        text = T.LlamaConfig(**{**decoder, "vocab_size": VOCAB + 1, "max_position_embeddings": LENGTH + IMAGE_TOKENS})
        return T.LlavaForConditionalGeneration(
            T.LlavaConfig(
                vision_config=vision,
                text_config=text,
                image_token_index=VOCAB,
                vision_feature_layer=-1,
                vision_feature_select_strategy="full",
            )
        )
    if kind == "reformer":
        return T.ReformerModelWithLMHead(
            T.ReformerConfig(
                vocab_size=VOCAB,
                hidden_size=16,
                num_attention_heads=2,
                attention_head_size=8,
                attn_layers=["local", "lsh", "local", "lsh"],
                feed_forward_size=32,
                axial_pos_shape=[4, 4],
                axial_pos_embds_dim=[8, 8],
                max_position_embeddings=LENGTH,
                local_attn_chunk_length=4,
                lsh_attn_chunk_length=4,
                num_buckets=2,
                num_hashes=1,
                hash_seed=0,
                is_decoder=True,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                lsh_attention_probs_dropout_prob=0.0,
                local_attention_probs_dropout_prob=0.0,
            )
        )
    if kind == "gpt_oss":
        return T.GptOssForCausalLM(
            T.GptOssConfig(
                **{**decoder, "intermediate_size": 16},
                head_dim=8,
                num_local_experts=4,
                num_experts_per_tok=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"],
            )
        )
    if kind == "gemma3n":
        return T.Gemma3nForCausalLM(
            T.Gemma3nTextConfig(
                **{**decoder, "intermediate_size": [64] * 4, "num_hidden_layers": 4},
                head_dim=8,
                vocab_size_per_layer_input=VOCAB,
                hidden_size_per_layer_input=8,
                num_kv_shared_layers=2,
                laurel_rank=4,
                altup_num_inputs=2,
                sliding_window=8,
                layer_types=["sliding_attention", "full_attention"] * 2,
                activation_sparsity_pattern=[0.0] * 4,
            )
        )
    if kind == "qwen3_next":
        return T.Qwen3NextForCausalLM(
            T.Qwen3NextConfig(
                **decoder,
                head_dim=8,
                linear_num_value_heads=4,
                linear_num_key_heads=2,
                linear_key_head_dim=8,
                linear_value_head_dim=8,
                linear_conv_kernel_dim=4,
                num_experts=4,
                num_experts_per_tok=2,
                moe_intermediate_size=16,
                shared_expert_intermediate_size=16,
                layer_types=["linear_attention", "full_attention"],
                decoder_sparse_step=1,
            )
        )
    if kind == "zamba":
        return T.ZambaForCausalLM(
            T.ZambaConfig(
                **{k: v for k, v in decoder.items() if k not in ("initializer_range", "num_hidden_layers")},
                attention_hidden_size=64,
                attention_head_dim=16,
                num_hidden_layers=4,
                layers_block_type=["mamba", "hybrid", "mamba", "hybrid"],
                mamba_d_state=4,
                mamba_d_conv=4,
                mamba_expand=2,
                mamba_dt_rank=4,
                n_mamba_heads=1,
            )
        )
    if kind == "resnet":
        return T.ResNetForImageClassification(
            T.ResNetConfig(
                num_channels=3, embedding_size=8, hidden_sizes=[8, 16], depths=[1, 1], layer_type="basic", num_labels=5
            )
        )
    if kind == "funnel":
        return T.FunnelForMaskedLM(
            T.FunnelConfig(
                vocab_size=VOCAB,
                d_model=32,
                n_head=2,
                d_head=16,
                d_inner=64,
                block_sizes=[1, 1],
                hidden_dropout=0.0,
                attention_dropout=0.0,
                activation_dropout=0.0,
                max_position_embeddings=LENGTH,
            )
        )
    if kind == "patchtst":
        return T.PatchTSTForPrediction(
            T.PatchTSTConfig(
                num_input_channels=2,
                context_length=LENGTH,
                patch_length=4,
                patch_stride=4,
                prediction_length=4,
                d_model=16,
                num_attention_heads=2,
                num_hidden_layers=2,
                ffn_dim=32,
                dropout=0.0,
                attention_dropout=0.0,
                ff_dropout=0.0,
                path_dropout=0.0,
                head_dropout=0.0,
            )
        )
    text = dict(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=LENGTH,
        hidden_dropout_prob=0.0,
        attention_probs_dropout_prob=0.0,
    )
    if kind == "squeezebert":
        return T.SqueezeBertForMaskedLM(
            T.SqueezeBertConfig(
                **text,
                embedding_size=32,
                q_groups=2,
                k_groups=2,
                v_groups=2,
                post_attention_groups=2,
                intermediate_groups=4,
                output_groups=4,
            )
        )
    if kind == "convnextv2":
        return T.ConvNextV2ForImageClassification(
            T.ConvNextV2Config(
                num_channels=3, hidden_sizes=[8, 16], depths=[1, 1], num_stages=2, num_labels=5, patch_size=2
            )
        )
    if kind == "rwkv":
        return T.RwkvForCausalLM(
            T.RwkvConfig(
                vocab_size=VOCAB,
                context_length=LENGTH,
                hidden_size=32,
                num_hidden_layers=2,
                attention_hidden_size=32,
                intermediate_size=64,
            )
        )
    if kind == "xlnet":
        return T.XLNetLMHeadModel(
            T.XLNetConfig(vocab_size=VOCAB, d_model=32, n_layer=2, n_head=2, d_inner=64, dropout=0.0)
        )
    if kind == "fnet":
        return T.FNetForMaskedLM(
            T.FNetConfig(**{k: v for k, v in text.items() if "attention" not in k}, use_tpu_fourier_optimizations=False)
        )
    if kind == "vit_mae":
        return T.ViTMAEForPreTraining(
            T.ViTMAEConfig(
                image_size=16,
                patch_size=4,
                hidden_size=16,
                num_hidden_layers=2,
                num_attention_heads=2,
                intermediate_size=32,
                hidden_dropout_prob=0.0,
                attention_probs_dropout_prob=0.0,
                decoder_hidden_size=16,
                decoder_num_hidden_layers=1,
                decoder_num_attention_heads=2,
                decoder_intermediate_size=32,
                mask_ratio=0.5,
            )
        )
    raise ValueError(kind)


def block_class(module: torch.nn.Module) -> type:
    """The class of the repeated block holding the most parameters: what a user lists for activation checkpointing."""
    lists = [m for m in module.modules() if isinstance(m, torch.nn.ModuleList) and len(m)]
    return type(max(lists, key=lambda blocks: sum(p.numel() for p in blocks.parameters()))[0])


class ZooModule(L.LightningModule):
    """The model's own loss on token windows (images and audio features made from them, a pure function of the
    batch); AdamW over 2 param groups."""

    def __init__(self, kind: str) -> None:
        super().__init__()
        self.kind, self.model = kind, build(kind)

    def training_step(self, batch, batch_idx):
        x = batch[0]
        if self.kind in VISION:
            loss = self.model(pixel_values=_image(x), labels=x[:, 0] % 5).loss
        elif self.kind == "vit_mae":  # the pixels of the patches its random mask hid, from those it kept
            loss = self.model(pixel_values=_image(x)).loss
        elif self.kind == "llava":  # the image tokens first, then the text; the loss on the text alone
            image = torch.full((x.shape[0], IMAGE_TOKENS), VOCAB)
            labels = torch.cat([torch.full_like(image, -100), x], 1)
            loss = self.model(input_ids=torch.cat([image, x], 1), pixel_values=_image(x), labels=labels).loss
        elif self.kind == "whisper":
            features = torch.sin(x[:, None, :].float() * torch.arange(1, 9)[:, None] / 3.0)  # (B, 8 mel bins, 16)
            loss = self.model(input_features=features, labels=x[:, 2:]).loss
        elif self.kind == "wav2vec2":  # 64 samples a window, 15 frames out, 4 CTC targets
            wave = torch.sin(x.float().repeat_interleave(4, dim=1) / 3.0)
            loss = self.model(input_values=wave, labels=x[:, :4]).loss
        elif self.kind == "patchtst":  # two series of 16 steps each a window, the next 4 steps to forecast
            rates = torch.tensor([1.0, 0.5])
            past, future = (
                torch.sin(x[:, :, None].float() * rates / 5.0),
                torch.cos(x[:, :4, None].float() * rates / 5.0),
            )
            loss = self.model(past_values=past, future_values=future).loss
        else:
            loss = self.model(input_ids=x, labels=x).loss
        self.log("train_loss", loss)
        return loss

    def configure_optimizers(self):
        decay = [p for p in self.parameters() if p.ndim >= 2]
        rest = [p for p in self.parameters() if p.ndim < 2]
        # CLIP's and Funnel's attention have key biases, whose true gradient is zero (softmax ignores a shift along the
        # keys): AdamW with eps 1e-8 turns their rounding noise into steps of lr (5e-5 apart after 3), as
        # test_hf_models' CLIP
        eps = 1e-6 if self.kind in ("llava", "funnel") else 1e-8
        groups = [{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}]
        return torch.optim.AdamW(groups, lr=3e-3, eps=eps)


def _image(x: torch.Tensor) -> torch.Tensor:
    """A 3 x 16 x 16 image a pure function of each token window."""
    return torch.sin(x[:, :, None].float() * torch.arange(1, 49) / 7.0).reshape(x.shape[0], 3, 16, 16)


def tokens() -> torch.utils.data.TensorDataset:
    return torch.utils.data.TensorDataset(
        torch.randint(3, VOCAB, (16, LENGTH), generator=torch.Generator().manual_seed(3))
    )
