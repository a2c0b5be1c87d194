import dataclasses
import json

import pytest

from gpt.config import (PRESETS, ModelConfig, SampleConfig, build, build_train, compute_from_dict,
                        model_from_dict, validate_sample)
from gpt.errors import UserError


def parse(argv, preset="default"):
    return build_train(argv, default_preset=preset)


def test_nanogpt_style_overrides():
    m, c, t, explicit = parse(["--preset=shakespeare-char", "--n_layer=4", "--dropout", "0.0",
                            "--batch_size=8", "--learning_rate=6e-4", "--no_bias", "--max_iters", "1e3"])
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size) == (4, 6, 384, 256)
    assert c.dropout == 0.0 and m.bias is False and t.batch_size == 8 and t.max_iters == 1000
    assert t.learning_rate == 6e-4 and t.beta2 == 0.99 and t.min_lr == 1e-4
    assert {"n_layer", "dropout", "batch_size"} <= explicit and "n_head" not in explicit


def test_presets():
    m, _, _, _ = parse(["--preset=gpt2-xl"])
    assert (m.n_layer, m.n_head, m.n_embd) == (48, 25, 1600)
    m, c, t, _ = parse(["--preset=shakespeare-char"])
    assert (m.n_layer, m.n_head, m.n_embd, m.block_size, c.dropout) == (6, 6, 384, 256, 0.2)
    assert (t.batch_size, t.max_iters, t.warmup_iters, t.grad_clip) == (64, 5000, 100, 1.0)
    assert m.activation == "gelu_tanh"
    assert parse(["--preset=shakespeare-char", "--activation=gelu"])[0].activation == "gelu"
    assert {"gpt2", "gpt2-medium", "gpt2-large", "gpt2-xl", "shakespeare-char", "tiny"} <= set(PRESETS)


def test_architecture_apart_from_compute_settings():
    """ModelConfig is the architecture only (frozen: what a checkpoint reproduces); how the model is
    run lives in ComputeConfig. A checkpoint written before the split (its model dict also held
    dtype, dropout, attention, remat, scan_layers) still loads: those keys are ignored."""
    m, c, _, _ = parse(["--preset=tiny", "--dtype=bfloat16", "--dropout=0.1", "--remat=dots"])
    assert "dtype" not in dataclasses.asdict(m) and (c.dtype, c.dropout, c.remat) == ("bfloat16", 0.1,
                                                                                      "dots")
    with pytest.raises(dataclasses.FrozenInstanceError):
        m.n_layer = 3
    old = {"vocab_size": 65, "block_size": 32, "n_layer": 2, "n_head": 2, "n_embd": 32, "dropout": 0.2,
           "bias": True, "pos_embedding": "learned", "activation": "gelu_tanh", "dtype": "auto",
           "attention": "auto", "remat": "none", "scan_layers": False}
    assert model_from_dict(old) == ModelConfig(vocab_size=65, block_size=32, n_layer=2, n_head=2,
                                               n_embd=32, bias=True)
    assert compute_from_dict(old).dropout == 0.2
    for bad in (float("nan"), float("inf")):  # the command line refuses these; an edited file too
        with pytest.raises(UserError, match="norm_eps=.*edited or is damaged"):
            model_from_dict({**old, "norm_eps": bad})


def test_unknown_key_suggests_closest():
    with pytest.raises(UserError, match=r"--n_layr .*did you mean --n_layer"):
        parse(["--n_layr=3"])
    with pytest.raises(UserError, match="unknown preset 'gpt3'"):
        parse(["--preset=gpt3"])
    with pytest.raises(UserError, match="--preset sets none of this command's settings"):
        build([SampleConfig], ["--preset=gpt2"])


@pytest.mark.parametrize("argv,field", [
    (["--n_embd=100", "--n_head=3"], "n_embd"),
    (["--n_layer=-1"], "n_layer"),
    (["--n_layer=0"], "n_layer"),
    (["--dropout=1.5"], "dropout"),
    (["--dropout=abc"], "dropout"),
    (["--batch_size=2.5"], "batch_size"),
    (["--learning_rate=0"], "learning_rate"),
    (["--learning_rate=nan"], "learning_rate"),
    (["--bias=maybe"], "bias"),
    (["--dtype=float16"], "dtype"),
    (["--remat=all"], "remat"),
    (["--activation=relu"], "activation"),
    (["--beta2=1.0"], "beta2"),
    (["--loss_chunks=-1"], "loss_chunks"),
])
def test_invalid_values_name_the_field(argv, field):
    with pytest.raises(UserError, match=f"--{field}"):
        parse(argv)


def test_learning_rate_below_the_presets_min_lr_suggests_one():
    """The default preset's min_lr is 4e-4: a lower --learning_rate alone says what to add."""
    with pytest.raises(UserError, match=r"--min_lr=0.0004 must not exceed --learning_rate=0.0001.*"
                                        r"--min_lr=1e-05"):
        parse(["--learning_rate=1e-4"])
    assert parse(["--learning_rate=1e-4", "--min_lr=1e-5"])[2].min_lr == 1e-5


def test_config_files_toml_and_json(tmp_path):
    toml = tmp_path / "run.toml"
    toml.write_text('n_layer = 3\n[train]\nbatch_size = 5\nlearning_rate = 3e-4\nmin_lr = 3e-5\n')
    m, _, t, _ = parse([f"--config={toml}", "--batch_size=7"])
    assert m.n_layer == 3 and t.batch_size == 7 and t.learning_rate == 3e-4  # command line wins
    js = tmp_path / "run.json"
    js.write_text(json.dumps({"model": {"n_embd": 64, "n_head": 4}}))
    m, _, _, _ = parse([f"--config={js}"])
    assert m.n_embd == 64
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"n_layers": 2}))
    with pytest.raises(UserError, match="did you mean --n_layer"):
        parse([f"--config={bad}"])
    with pytest.raises(UserError, match="not found"):
        parse([f"--config={tmp_path / 'missing.toml'}"])
    for text, match in (("n_layer = [1, 2]", "--n_layer expects a single value, got \\[1, 2\\]"),
                        ("learning_rate = [0.1]", "--learning_rate expects a single value"),
                        ("seed = {a = 1}", "--seed expects a single value"),
                        ("input = [{a = 1}]", "--input expects a list of plain values"),
                        ('preset = "tiny"', "sets preset, which is a command-line flag: pass --preset=")):
        (tmp_path / "t.toml").write_text(text + "\n")
        with pytest.raises(UserError, match=match):
            parse([f"--config={tmp_path / 't.toml'}"])
    (tmp_path / "n.json").write_text(json.dumps({"max_iters": None}))
    with pytest.raises(UserError, match="--max_iters expects a single value, got None"):
        parse([f"--config={tmp_path / 'n.json'}"])
    (tmp_path / "c.toml").write_text("[compute]\ndropout = 0.25\n")  # a checkpoint's layout
    assert parse([f"--config={tmp_path / 'c.toml'}"])[1].dropout == 0.25
    for name, text in (("deep.json", "[" * 100_000 + "]" * 100_000), ("deep.toml", "a=" + "[" * 100_000)):
        (tmp_path / name).write_text(text)  # a RecursionError in the parsers, not a decode error
        with pytest.raises(UserError, match=f"config file .*{name} is not valid"):
            parse([f"--config={tmp_path / name}"])
    evil = tmp_path / "evil.py"
    evil.write_text("import os\n")
    with pytest.raises(UserError, match=r"\.toml or \.json"):
        parse([f"--config={evil}"])


@pytest.mark.parametrize("argv,field", [
    (["--top_p=0"], "top_p"), (["--top_p=1.5"], "top_p"), (["--top_k=-1"], "top_k"),
    (["--temperature=-0.1"], "temperature"), (["--num_samples=0"], "num_samples"),
    (["--max_new_tokens=-5"], "max_new_tokens"), (["--num_draft_tokens=0"], "num_draft_tokens"),
    (["--num_draft_tokens=33"], "num_draft_tokens"),
    (["--temperature=1e38"], "temperature"), (["--temperature=1e-40"], "temperature"),  # NaN, not text
    (["--stop="], "stop"), (["--stop=END", "--stop="], "stop"),  # would cut every sample at its start
])
def test_sample_settings_validated(argv, field):
    (s,), _ = build([SampleConfig], argv)
    with pytest.raises(UserError, match=f"--{field}"):
        validate_sample(s)


def test_list_fields():
    (s,), _ = build([SampleConfig], ["--stop=\n\n", "--stop", "END", "--stop=a,b"])
    assert s.stop == ["\n\n", "END", "a,b"]  # a repeated list flag accumulates
    _, _, t, _ = parse(["--input=a.txt,b/"])
    assert t.input == ["a.txt", "b/"]


def test_help_shows_the_values_a_run_starts_from():
    """--help lists each setting as the run would start from it (`build`: the preset, the default
    one without --preset, then the command line), so `python train.py --help` says 4 layers, not
    12; a command line that does not build gives its error and the fields' own defaults."""
    from gpt.config import TRAIN_CLASSES, help_text
    plain = help_text(TRAIN_CLASSES, ["--help"], default_preset="default").splitlines()
    assert "  --n_layer=4" in plain and "  --learning_rate=0.004" in plain and "  presets: " in plain[1]
    gpt2 = help_text(TRAIN_CLASSES, ["--preset", "gpt2", "--preset=tiny", "--dropout=0.1"], "default")
    assert "  --n_layer=12" in gpt2.splitlines() and "  --dropout=0.1" in gpt2.splitlines()  # the first preset
    bad = help_text(TRAIN_CLASSES, ["--preset=gpt3", "-h"], "default").splitlines()
    assert "unknown preset 'gpt3' (did you mean gpt2?)" in bad[2] and "  --n_layer=12" in bad
    sample = help_text([SampleConfig]).splitlines()  # no preset sets a sampling setting
    assert "preset" not in sample[0] and sample[1] == "  values as this command line sets them:"


def test_input_flags_of_gpt_data():
    """train.py --input takes gpt.data's --errors and --include, which its messages advise; an
    empty --input (an unset shell variable) is refused, not the bundled corpus trained on."""
    _, _, t, _ = parse(["--input=a/", "--errors=replace", "--include=*.md,*.txt"])
    assert t.errors == "replace" and t.include == ["*.md", "*.txt"]
    with pytest.raises(UserError, match="--errors=lenient is not valid"):
        parse(["--errors=lenient"])
    with pytest.raises(UserError, match="--input names no file"):
        parse(["--input="])


def test_hyphens_work_for_on_off_flags_too():
    """--max-iters=3 worked but --no-progress and a bare --scan-layers were refused."""
    m, c, t, _ = parse(["--no-progress", "--scan-layers", "--max-iters=3"])
    assert t.progress is False and c.scan_layers is True and t.max_iters == 3


def test_a_constant_schedule_needs_no_min_lr_below_it():
    """The constant rate never reads --min_lr (the default preset's 4e-4 was refused above 1e-4)."""
    assert parse(["--lr_schedule=constant", "--learning_rate=1e-4"])[2].learning_rate == 1e-4
    assert parse(["--lr_schedule=constant", "--learning_rate=1e-4", "--min_lr=1e-5"])[2].min_lr == 1e-5


@pytest.mark.parametrize("argv, words", [
    (["--warmup_iters=50", "--max_iters=20"], "never reaches --learning_rate"),
    (["--warmup_iters=10", "--lr_decay_iters=5", "--max_iters=20"], "drops from its peak"),
    (["--lr_schedule=wsd", "--warmup_iters=18", "--max_iters=20", "--lr_decay_iters=20"], "never holds the peak"),
    (["--lr_schedule=wsd", "--max_iters=1000"], "the run ends at the peak rate"),  # the preset's 2000
    (["--lr_schedule=wsd", "--max_iters=1000", "--lr_decay_iters=0"], None),
    (["--warmup_iters=10", "--max_iters=100"], None)])
def test_schedules_that_undo_themselves_are_warned_of(argv, words):
    from gpt.config import schedule_warnings
    got = schedule_warnings(parse(argv)[2])
    assert (got == []) if words is None else (len(got) == 1 and words in got[0])


def test_an_empty_init_from_is_refused():
    """It was read as the directory '.', and the error then named --out_dir=."""
    with pytest.raises(UserError, match="--init_from must not be empty"):
        parse(["--init_from="])


def test_sizes_past_int32_are_one_line():
    """They aborted XLA (n_layer) or numpy (batch_size) with a traceback."""
    for argv in (["--n_layer=10000000000000000"], ["--batch_size=100000000000000000000"],
                 ["--gradient_accumulation_steps=1e13"]):
        with pytest.raises(UserError, match="beyond what any setting takes"):
            parse(argv)


def test_decode_kernels_is_auto_true_or_false():
    """sample.py --decode_kernels: auto by default (the kernels wherever they run, as --help shows);
    a bare flag is true, --no_decode_kernels false, a bool's spellings and a config file's true
    too; anything else is one line naming the three."""
    from gpt.config import SampleConfig, build, help_text, validate_sample
    from gpt.errors import UserError

    def value(*argv):
        return validate_sample(build([SampleConfig], list(argv))[0][0]).decode_kernels
    assert value() == "auto" and "--decode_kernels='auto'" in help_text([SampleConfig])
    assert value("--decode_kernels") == value("--decode_kernels=yes") == "true"
    assert value("--no_decode_kernels") == value("--decode_kernels=0") == value("--decode_kernels", "off") == "false"
    assert value("--decode_kernels=AUTO", "--prompt=x") == "auto"
    with pytest.raises(UserError, match="--decode_kernels expects auto, true or false, got 'maybe'"):
        value("--decode_kernels=maybe")
