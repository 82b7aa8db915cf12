"""check_draft_compatible: can this draft model draft for this target? Checked when a pair is loaded.

A draft proposes token ids that the target judges, so both must read ids the same way: the same
logits width (vocab_size) and, when their folders are known, the same tokenizer vocabulary (token
-> id). They must also be the same kind of model: an encoder-decoder target (T5, BART, ...) needs an
encoder-decoder draft, which reads the same encoder input; a decoder-only draft could not.

    target, draft = load_engine(target_dir), load_engine(draft_dir)
    check_draft_compatible(target, draft, target_dir, draft_dir)   # IncompatibleDraftError if not
"""

from __future__ import annotations

from pathlib import Path

from specmesh.models.encdec import is_encoder_decoder


class IncompatibleDraftError(ValueError):
    """A draft model that cannot draft for the target; the message says why and what to use instead."""


def _kind(engine) -> str:
    return "an encoder-decoder model" if is_encoder_decoder(engine) else "a decoder-only model"


def check_draft_compatible(target, draft, target_folder: str | Path | None = None,
                           draft_folder: str | Path | None = None) -> None:
    """Raise IncompatibleDraftError unless `draft` (an Engine) can draft for `target` (an Engine)."""
    if is_encoder_decoder(target) != is_encoder_decoder(draft):
        raise IncompatibleDraftError(
            f"the target is {_kind(target)} but the draft is {_kind(draft)}: speculative decoding needs a draft "
            "of the same kind and vocabulary (e.g. a small T5 for a T5 target, a small Llama for a Llama target)")
    if target.vocab_size != draft.vocab_size:
        raise IncompatibleDraftError(
            f"the draft's vocabulary has {draft.vocab_size} tokens, the target's {target.vocab_size}: draft and "
            "target must share one tokenizer (e.g. two checkpoints of one model family)")
    if target_folder is not None and draft_folder is not None and Path(target_folder).resolve() != Path(draft_folder).resolve():
        target_vocab, draft_vocab = _tokenizer_vocab(target_folder), _tokenizer_vocab(draft_folder)
        if target_vocab is not None and draft_vocab is not None and target_vocab != draft_vocab:
            differing = sorted(set(target_vocab.items()) ^ set(draft_vocab.items()))[:3]
            raise IncompatibleDraftError(
                f"the draft's tokenizer ({draft_folder}) maps tokens to other ids than the target's ({target_folder}), "
                f"e.g. {differing}: draft and target must share one tokenizer")


def _tokenizer_vocab(folder: str | Path) -> dict[str, int] | None:
    """The folder's tokenizer vocabulary (token -> id), or None when the folder has no tokenizer."""
    from transformers import AutoTokenizer

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder)
    except (OSError, ValueError):
        return None
    return dict(tokenizer.get_vocab())
