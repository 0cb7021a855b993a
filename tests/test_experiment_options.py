"""Each experiment's options: a frozen dataclass that states every option's type and default once,
reads values given as text, and refuses bad values and unknown names."""

import dataclasses

import pytest

import lowprec_demo as lp
from lowprec_demo.book.experiments import (ExperimentOptions, GPT2Options, LanguageModelOptions, MLPOptions, MNISTOptions, NanoGPTOptions, QuadraticOptions, RegressionOptions, check_settings, config_fields, experiment_names, get_experiment, make_config)

OPTION_CLASSES = {"quadratic": QuadraticOptions, "regression": RegressionOptions, "mlp": MLPOptions,
                  "mnist": MNISTOptions, "nanogpt": NanoGPTOptions, "gpt2": GPT2Options}


def test_every_experiment_has_its_options_class():
    assert set(experiment_names()) == set(OPTION_CLASSES)
    for name, cls in OPTION_CLASSES.items():
        exp = get_experiment(name)
        assert exp.option_class is cls and issubclass(cls, ExperimentOptions)
        assert exp.options == cls.names() == tuple(f.name for f in dataclasses.fields(cls))


def test_defaults():
    assert QuadraticOptions() == QuadraticOptions(dim=64, c_min=0.2, c_max=1.0, t_min=1.0, t_max=2.0, noise=0.0)
    assert (RegressionOptions().features, RegressionOptions().batch_size, RegressionOptions().noise) == (128, 0, 0.03)
    assert (MLPOptions().hidden, MLPOptions().activation, MLPOptions().samples) == (64, "tanh", 2048)
    assert (MNISTOptions().batch_size, MNISTOptions().prefer_full) == (64, True)
    assert NanoGPTOptions().model == "nanogpt-quick" and NanoGPTOptions().n_layer is None
    assert NanoGPTOptions().bias is None
    assert (GPT2Options().model, GPT2Options().context, GPT2Options().tf32) == ("gpt2", None, False)
    # the GPT experiments share these three
    for cls in (NanoGPTOptions, GPT2Options):
        assert issubclass(cls, LanguageModelOptions)
        assert (cls().batch_size, cls().val_fraction, cls().eval_batches) == (12, 0.1, 4)


@pytest.mark.parametrize("name", sorted(OPTION_CLASSES))
def test_no_options_given_means_every_default(name):
    cls = OPTION_CLASSES[name]
    assert cls.from_options({}) == cls()


@pytest.mark.parametrize("name", sorted(OPTION_CLASSES))
@pytest.mark.parametrize("scale", ["quick", "full"])
def test_the_scales_defaults_parse_to_the_same_values(name, scale):
    recorded = make_config(name, scale).options
    parsed = OPTION_CLASSES[name].from_options(recorded)
    assert parsed.to_dict(*recorded) == recorded
    for key, value in recorded.items():
        assert type(getattr(parsed, key)) is type(value), (name, scale, key)


def test_scale_defaults_record_what_they_always_recorded():
    assert make_config("quadratic", "full").options == {"dim": 4096, "c_min": 0.2, "c_max": 1.0, "t_min": 1.0,
                                                         "t_max": 2.0, "noise": 0.0}
    assert make_config("mnist", "quick").options == {"batch_size": 64, "prefer_full": False, "eval_samples": 0,
                                                     "train_samples": 0}
    assert make_config("nanogpt", "full").options == {"model": "shakespeare-char", "batch_size": 64,
                                                      "eval_batches": 8}
    assert list(make_config("gpt2", "quick").options) == ["model", "context", "batch_size", "eval_batches"]


def test_text_is_read_as_the_options_type():
    o = NanoGPTOptions.from_options({"bias": "false", "batch_size": "16", "val_fraction": "0.2", "n_layer": " 3 ",
                                     "n_head": "None", "model": "shakespeare-char"})
    assert (o.bias, o.batch_size, o.val_fraction, o.n_layer, o.n_head, o.model) == \
        (False, 16, 0.2, 3, None, "shakespeare-char")
    assert type(o.val_fraction) is float and type(o.batch_size) is int
    for text, flag in [("true", True), ("Yes", True), ("on", True), ("1", True), ("off", False), ("0", False)]:
        assert MNISTOptions.from_options({"prefer_full": text}).prefer_full is flag
    assert GPT2Options.from_options({"tf32": "false"}).tf32 is False


def test_values_of_the_type_or_close_to_it_are_taken():
    o = QuadraticOptions.from_options({"dim": 8.0, "noise": 0, "c_min": 0.5})
    assert (o.dim, o.noise, o.c_min) == (8, 0.0, 0.5)
    assert type(o.dim) is int and type(o.noise) is float
    assert MNISTOptions.from_options({"prefer_full": 0}).prefer_full is False
    assert NanoGPTOptions.from_options({"bias": None}).bias is None


@pytest.mark.parametrize("cls, options, message", [
    (QuadraticOptions, {"dim": "abc"}, "option dim takes an integer, not 'abc'"),
    (QuadraticOptions, {"dim": 2.5}, "option dim takes an integer"),
    (QuadraticOptions, {"dim": True}, "option dim takes an integer"),
    (QuadraticOptions, {"dim": None}, "option dim takes an integer, not None"),
    (QuadraticOptions, {"noise": "loud"}, "option noise takes a number"),
    (MLPOptions, {"activation": 3}, "option activation takes text"),
    (MNISTOptions, {"prefer_full": "maybe"}, "option prefer_full takes true or false"),
    (NanoGPTOptions, {"bias": "maybe"}, "option bias takes true or false or None, not 'maybe'"),
    (NanoGPTOptions, {"n_layer": "two"}, "option n_layer takes an integer or None"),
    (GPT2Options, {"context": [64]}, "option context takes an integer or None"),
])
def test_bad_values_name_the_option_and_the_type(cls, options, message):
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        cls.from_options(options)


def test_unknown_names_are_refused_with_the_valid_ones():
    with pytest.raises(ValueError, match="unknown option 'depth' for QuadraticOptions; its options: dim, c_min, "
                                         "c_max, t_min, t_max, noise"):
        QuadraticOptions.from_options({"depth": 2})
    with pytest.raises(ValueError, match="unknown options 'a', 'b'"):
        MNISTOptions.from_options({"a": 1, "b": 2, "batch_size": 3})


@pytest.mark.parametrize("name", sorted(OPTION_CLASSES))
def test_check_settings_lists_the_options_and_the_config_fields(name):
    with pytest.raises(ValueError) as error:
        check_settings(name, {"nosuchkey": 1})
    message = str(error.value)
    assert message.startswith(f"unknown setting 'nosuchkey' for {name}; {name}'s options: ")
    assert f"{name}'s options: {', '.join(OPTION_CLASSES[name].names())}; " in message
    assert message.endswith(f"config fields: {', '.join(config_fields())}")


def test_options_are_frozen_and_to_dict_gives_all_or_the_named():
    o = QuadraticOptions(dim=8)
    with pytest.raises(dataclasses.FrozenInstanceError):
        o.dim = 9
    assert o.to_dict() == {"dim": 8, "c_min": 0.2, "c_max": 1.0, "t_min": 1.0, "t_max": 2.0, "noise": 0.0}
    assert list(o.to_dict("noise", "dim")) == ["noise", "dim"]


def test_types_say_which_options_may_be_none():
    assert QuadraticOptions.types() == {"dim": (int, False), "c_min": (float, False), "c_max": (float, False),
                                        "t_min": (float, False), "t_max": (float, False), "noise": (float, False)}
    types = GPT2Options.types()
    assert types["context"] == (int, True) and types["tf32"] == (bool, False) and types["model"] == (str, False)


def test_the_command_line_reads_options_as_their_declared_type():
    from lowprec_demo.book.cli import SettingError, parse_sets
    assert parse_sets("nanogpt", ["bias=false", "n_layer=3", "n_head=None"], "full") == \
        {"bias": False, "n_layer": 3, "n_head": None}
    assert parse_sets("gpt2", ["tf32=true", "context=32"]) == {"tf32": True, "context": 32}
    with pytest.raises(SettingError, match="--set n_layer=x: n_layer takes an integer or None"):
        parse_sets("nanogpt", ["n_layer=x"], "full")


def test_a_build_reads_text_options():
    config = make_config("quadratic", steps=3, dim="5", noise="0")
    task = get_experiment("quadratic").build(config)
    assert task.make_model(None).w.numel() == 5
    assert lp.book.make_config("mnist", batch_size="16").options["batch_size"] == "16"   # recorded as given
