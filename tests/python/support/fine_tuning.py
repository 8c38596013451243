"""What the fine-tuning tests train with: a tokenizer for the tiny Llama's 64 ids, a Trainer
callback that records each step's gradients, and a LightningModule that applies a recompute config
in configure_model."""

import torch
import transformers

VOCAB = 64


def tiny_tokenizer():
    """A word-level tokenizer over the ids "0" to "63", built in memory (no download)."""
    from tokenizers import Tokenizer, models

    vocabulary = {str(i): i for i in range(VOCAB)}
    tokenizer = Tokenizer(models.WordLevel(vocabulary, unk_token="0"))
    return transformers.PreTrainedTokenizerFast(tokenizer_object=tokenizer, pad_token="0", eos_token="1")


def gradients_of(model) -> dict:
    return {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}


class GradientRecorder(transformers.TrainerCallback):
    """Each optimizer step's gradients, as the optimizer sees them."""

    def __init__(self):
        self.gradients = []

    def on_pre_optimizer_step(self, args, state, control, model=None, **kwargs):
        self.gradients.append(gradients_of(model))


def lightning_module(lightning, model, config):
    """A LightningModule training `model` (a transformers causal LM) with AdamW; with a config, its
    configure_model applies it, once (Lightning may call configure_model again)."""
    import sac_plugin

    class CausalLM(lightning.LightningModule):
        def __init__(self):
            super().__init__()
            self.model = model
            self.losses, self.gradients = [], []
            self._configured = False

        def configure_model(self):
            if config is not None and not self._configured:
                sac_plugin.apply_recompute_config(self.model, config)
            self._configured = True

        def training_step(self, batch, batch_index):
            loss = self.model(**batch).loss
            self.losses.append(loss.detach().clone())
            return loss

        def on_before_optimizer_step(self, optimizer):
            self.gradients.append(gradients_of(self.model))

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    return CausalLM()
