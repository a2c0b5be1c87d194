"""Sample from a trained model: `python sample.py --prompt "ROMEO:" [--key=value ...]`."""
from __future__ import annotations

import sys
from typing import Sequence

from gpt.errors import UserError, reader_may_leave, run_main


MAX_PROMPT_CHARS = 10_000_000


def read_prompt(cfg, tokenizer, notes: list[str] | None = None) -> list[int]:
    """The prompt's ids; `notes`: where the note of an empty prompt goes (else stderr, now)."""
    from gpt.config import is_utf8
    text = cfg.prompt
    if cfg.prompt_file:
        try:
            # As the corpus is read: line ends kept (CRLF stays CRLF), an editor's byte-order mark dropped.
            with open(cfg.prompt_file, encoding="utf-8-sig", newline="") as f:
                text = f.read(MAX_PROMPT_CHARS + 1)  # bounded: /dev/zero or a fifo never ends
        except (OSError, UnicodeDecodeError) as e:
            raise UserError(f"cannot read --prompt_file={cfg.prompt_file}: {e.__class__.__name__}: "
                            f"{e}") from None
        if len(text) > MAX_PROMPT_CHARS or "\x00" in text:
            raise UserError(f"--prompt_file={cfg.prompt_file} is not a text prompt (over {MAX_PROMPT_CHARS:,} "
                            f"characters, or NUL bytes); pass a text file")
    flag = "--prompt_file" if cfg.prompt_file else "--prompt"
    if not is_utf8(text):  # bytes that are not UTF-8 reach argv as lone surrogates
        raise UserError(f"{flag} is not valid UTF-8 text; pass the prompt as UTF-8")
    try:
        ids = tokenizer.encode_prompt(text)
    except UserError as e:  # a character the char tokenizer lacks
        raise UserError(f"{flag}: {e}") from None
    # A tokenizer.json's template may name an id its vocabulary lacks, which the embedding would clamp.
    outside = [i for i in ids if not 0 <= i < tokenizer.vocab_size]
    if outside:
        raise UserError(f"the tokenizer made {flag} into id {outside[0]}, outside its {tokenizer.vocab_size} "
                        f"tokens (its tokenizer.json's template names it); fix that template")
    return ids or start_ids(tokenizer, notes)


def start_ids(tokenizer, notes: list[str] | None = None) -> list[int]:
    """What an empty prompt starts from: the end-of-text token, else a newline (as nanoGPT)."""
    say = (lambda note: print(f"note: {note}", file=sys.stderr)) if notes is None else notes.append
    if tokenizer.eot_id is not None:
        say("empty prompt; starting from the end-of-text token")
        return [tokenizer.eot_id]
    try:
        ids = tokenizer.encode("\n")
    except UserError:  # a char alphabet without a newline
        ids = []
    if not ids:
        raise UserError("the prompt is empty and this model's vocabulary has no newline to start from; "
                        "pass --prompt with some of its text")
    say("empty prompt; starting from a newline")
    return ids


def main(argv: Sequence[str]) -> int:
    from gpt.config import SampleConfig, build, help_text, validate_sample
    if "-h" in argv or "--help" in argv:
        with reader_may_leave():  # `--help | head`
            print(help_text([SampleConfig]))
        return 0
    (cfg,), explicit = build([SampleConfig], argv)
    validate_sample(cfg)
    if hasattr(sys.stdout, "reconfigure"):  # text a terminal's encoding lacks: "?", not a traceback
        sys.stdout.reconfigure(errors="replace")
    check_flags(cfg, explicit)

    import jax

    from gpt.runtime import prepare_process
    from gpt.tokenizer import RowText
    prepare_process()

    tok, prompt, notes, model, draft = load_run(cfg)
    if cfg.top_k > model.cfg.vocab_size:  # keeps every token, as nanoGPT and transformers take it
        if "top_k" in explicit:
            print(f"note: --top_k={cfg.top_k} exceeds the vocabulary ({model.cfg.vocab_size} tokens): "
                  f"every token is kept", file=sys.stderr)
        cfg.top_k = 0
    for note in notes + length_notes(len(prompt) + cfg.max_new_tokens, model, draft, cfg.num_draft_tokens):
        print(f"note: {note}", file=sys.stderr)
    sampler = make_sampler(cfg, model, draft, tok)
    state = sampler.start([prompt] * cfg.num_samples, jax.random.key(cfg.seed))
    decoders = [RowText(tok, prompt) for _ in range(cfg.num_samples)]  # each row's text so far
    texts = lambda state: row_texts(sampler, state, prompt, decoders, cfg)
    # an empty prompt starts from the end-of-text token, which is not text to show (HF skips it too)
    shown = "" if prompt == [tok.eot_id] else tok.decode(prompt)
    with reader_may_leave():  # `sample.py | head`
        if cfg.stream and cfg.num_samples == 1:
            state = stream_one(sampler, state, shown, texts, cfg.stop)
        else:
            state = print_all(sampler, state, shown, texts)
    # no note without rounds (--max_new_tokens=0, a prompt past the window): nothing to say
    if cfg.draft_out_dir and (stats := sampler.stats(state))["drafted"]:
        print(f"note: speculative decoding: the target kept {100 * stats['acceptance_rate']:.0f}% of "
              f"the draft's {stats['drafted']} tokens", file=sys.stderr)
    return 0


def check_flags(cfg, explicit: set[str]) -> None:
    """The flags' combinations, before JAX is imported. An empty --prompt_file or --draft_out_dir
    (`--prompt_file="$UNSET"`) would read as none given: the default prompt sampled, or no draft,
    without a word."""
    if "prompt" in explicit and "prompt_file" in explicit:
        raise UserError("give either --prompt or --prompt_file, not both")
    if "prompt_file" in explicit and not cfg.prompt_file:
        raise UserError("--prompt_file names no file; pass a text file, or leave --prompt_file out "
                        "(and give the prompt with --prompt)")
    if "draft_out_dir" in explicit and not cfg.draft_out_dir:
        raise UserError("--draft_out_dir names no folder; pass the draft's out_dir, or leave "
                        "--draft_out_dir out to sample without a draft")
    if "num_draft_tokens" in explicit and not cfg.draft_out_dir:
        raise UserError("--num_draft_tokens needs --draft_out_dir (the draft model that proposes them)")


def load_run(cfg):
    """(tokenizer, prompt ids, notes to print, model, draft or None). What the user gave is checked
    before any weights are read: the prompt against the checkpoint's tokenizer, the draft's
    tokenizer against the target's. Notes wait until the models have loaded, so that an error
    there is one line."""
    import jax

    from gpt.checkpoint import load_model, load_tokenizer_of
    from gpt.runtime import decoding_dtype
    from gpt.sampling import decode_kernels_by_default, with_decode_kernels
    from gpt.speculative import check_draft, load_draft

    cfg.dtype = decoding_dtype(cfg.dtype)
    tok = load_tokenizer_of(cfg.out_dir)
    notes: list[str] = []
    prompt = read_prompt(cfg, tok, notes)
    draft_tok = check_draft(cfg.draft_out_dir, tok, cfg.out_dir) if cfg.draft_out_dir else None
    model, _, _ = load_model(cfg.out_dir, cfg.dtype, tok=tok)
    draft = None
    if cfg.draft_out_dir:
        draft = load_draft(cfg.draft_out_dir, cfg.dtype, model, tok, cfg.out_dir, cfg.num_draft_tokens,
                           draft_tok)
    run = (model, cfg.num_samples, draft is not None, jax.default_backend())
    if cfg.decode_kernels == "true" or (cfg.decode_kernels == "auto" and decode_kernels_by_default(*run)):
        model = with_decode_kernels(*run)
    return tok, prompt, notes, model, draft


def length_notes(total: int, model, draft, k: int) -> list[str]:
    """What happens past block_size for `total` tokens (prompt + new): the target's window, and
    with a draft, where speculative rounds stop. A round writes k + 1 tokens into each model's
    cache; one with learned or sinusoidal positions cannot roll its cache, so once a round no
    longer fits either model's block_size the target decodes alone (gpt/speculative.py)."""
    from gpt.sampling import rolls
    notes, bs = [], model.cfg.block_size
    if total > bs:
        how = "a rolling KV cache" if rolls(model.cfg) else "recomputed windows, as nanoGPT does"
        notes.append(f"prompt + new tokens ({total}) exceed block_size {bs}; each token attends to the last "
                     f"{bs} ({how})")
    fixed = [(m.cfg.block_size, name) for m, name in ((model, "target"), (draft, "draft"))
             if m is not None and not rolls(m.cfg)]
    if draft is not None and fixed and total > min(fixed)[0] - k:
        limit, name = min(fixed)
        notes.append(f"speculative rounds stop after about {limit - k} tokens (the {name}'s block_size {limit} "
                     f"less {k} drafted: its positions cannot roll); the target decodes alone from there")
    return notes


def make_sampler(cfg, model, draft, tok):
    """The plain sampler, or with a draft the speculative one (same interface)."""
    from gpt.sampling import Sampler, settings_from
    settings = settings_from(cfg, tok.eot_id, tok.stop_ids)
    if draft is None:
        return Sampler(model, settings)
    from gpt.speculative import SpeculativeSampler
    return SpeculativeSampler(model, draft, settings, cfg.num_draft_tokens)


def row_texts(sampler, state, prompt: list[int], decoders: list, cfg) -> list[tuple[str, bool]]:
    """Each row's new text, cut at a stop string or end-of-text, and whether it has ended."""
    out, ends = [], sampler.settings.end_ids
    for row, decoder in zip(sampler.new_tokens(state, [prompt] * cfg.num_samples), decoders):
        ended = bool(row) and row[-1] in ends
        text = decoder.text(row[:-1] if ended else row)
        cut = min((text.find(s) for s in cfg.stop if s in text), default=-1)
        out.append((text[:cut], True) if cut >= 0 else (text, ended))
    return out


def stream_one(sampler, state, prompt_text: str, texts, stop: list[str]):
    """Print one sample as it is decoded, chunk by chunk; returns the last state."""
    hold = max((len(s) for s in stop), default=1) - 1  # a stop string may straddle chunks
    sys.stdout.write(prompt_text)
    printed = 0
    for state in sampler.chunks(state):
        (text, stopped), = texts(state)
        # Hold back what might be the start of a stop string or of a multi-byte character.
        safe = len(text) if stopped else len(text.rstrip("\ufffd")) - hold
        if safe > printed:
            sys.stdout.write(text[printed:safe])
            sys.stdout.flush()
            printed = safe
        if stopped:
            break
    (text, _), = texts(state)
    sys.stdout.write(text[printed:] + "\n")
    return state


def print_all(sampler, state, prompt_text: str, texts):
    """Decode every row to its end, then print the samples separated by a rule; returns the last
    state."""
    final = state
    for final in sampler.chunks(state):
        if all(stopped for _, stopped in texts(final)):
            break
    for i, (text, _) in enumerate(texts(final)):
        if i:
            print("---------------")
        print(prompt_text + text)
    return final


if __name__ == "__main__":
    run_main(main, sys.argv[1:])
