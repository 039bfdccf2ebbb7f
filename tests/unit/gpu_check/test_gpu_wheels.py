"""The wheel set carried to the device, held to the device's own package list (scripts/device_packages.txt) without
building it: every Requires-Dist of every carried wheel (as recorded from the wheels' METADATA in
scripts/device_wheels.json by `make gpu-wheels`) is met by that list or the set, markers evaluated for the device's
Python 3.12 on x86-64 Linux; nothing the device has is carried unless another version is needed; the set is the one
this virtualenv's metadata gives."""

from __future__ import annotations

import json

import pytest

from tests.conftest import load_script


@pytest.fixture(scope="module")
def gpu_wheels():
    return load_script("gpu_wheels")


@pytest.fixture(scope="module")
def recorded(gpu_wheels):
    return json.loads(gpu_wheels.SET_RECORD.read_text())


def requires_and_versions(recorded: dict) -> tuple[dict, dict]:
    wheels = recorded["wheels"]
    return ({name: entry["requires"] for name, entry in wheels.items()},
            {name: entry["version"] for name, entry in wheels.items()})


def test_every_requirement_of_the_recorded_set_is_met_by_the_device_or_the_set(gpu_wheels, recorded):
    device = gpu_wheels.read_device_packages()
    requires, carried = requires_and_versions(recorded)
    assert recorded["python_version"] == gpu_wheels.DEVICE_PYTHON == device["python"][:4]
    assert gpu_wheels.unmet(requires, device, carried) == [] and recorded["unmet"] == []
    # DeepSpeed imports pydantic, which the device lacks (its typer does not bring it): it and its needs travel
    assert {"deepspeed", "pydantic", "pydantic-core", "annotated-types", "typing-inspection"} <= set(carried)


def test_a_missing_or_wrong_version_requirement_is_found(gpu_wheels, recorded):
    device = gpu_wheels.read_device_packages()
    requires, carried = requires_and_versions(recorded)
    without = {name: version for name, version in carried.items() if name != "pydantic"}
    problems = gpu_wheels.unmet({k: v for k, v in requires.items() if k != "pydantic"}, device, without)
    assert problems == ["deepspeed 0.19.8 requires pydantic>=2.0.0: neither the device nor the set has it"]
    old_arrow = {**device, "pyarrow": "20.0.0"}
    assert gpu_wheels.unmet(requires, old_arrow, carried) == [
        "datasets 5.2.0 requires pyarrow>=24.0.0: the device has 20.0.0"]
    # the carried transformers, not the device's 5.17, is what peft and the rest import
    assert not any("transformers" in problem for problem in gpu_wheels.unmet(requires, device, carried))
    old_tokenizers = {**device, "tokenizers": "0.22.0"}
    assert gpu_wheels.unmet(requires, old_tokenizers, carried) == [
        "transformers 5.24.0 requires tokenizers<0.24.0,>=0.23.1: the device has 0.22.0"]


def test_nothing_the_device_has_is_carried_unless_another_version_is_needed(gpu_wheels, recorded):
    device = gpu_wheels.read_device_packages()
    pins = gpu_wheels.read_pins()
    _, carried = requires_and_versions(recorded)
    for name, version in carried.items():
        if name in device:
            assert name in gpu_wheels.PINNED and device[name] != version == pins[name], name
    assert not {"pyarrow", "pandas", "xxhash", "msgpack", "einops", "ninja", "py-cpuinfo", "python-dateutil",
                "torch", "accelerate"} & set(carried)  # the device's own (accelerate at the pinned 1.15.0)
    assert carried["transformers"] == pins["transformers"] and carried["peft"] == pins["peft"]
    assert sum(entry["bytes"] for entry in recorded["wheels"].values()) <= gpu_wheels.WHEELS_LIMIT_MIB * 2**20


def test_the_recorded_set_is_the_one_this_virtualenvs_metadata_gives(gpu_wheels, recorded):
    """Names, and the pinned versions (a transitive one may differ between installs; its range is checked above)."""
    computed = gpu_wheels.wheel_set(gpu_wheels.read_device_packages(), gpu_wheels.read_pins())
    _, carried = requires_and_versions(recorded)
    assert set(computed) == set(carried)
    pins = gpu_wheels.read_pins()
    assert all(carried[name] == pins[name] for name in computed if name in pins)



def test_the_running_environment_is_checked_against_the_sets_requirements(gpu_wheels, recorded):
    """What gpu_check reads on the device before its cases (the ranges the list gives no version for): here, where
    the pinned versions are installed, nothing is missing; a range no installed version meets is named."""
    assert gpu_wheels.installed_problems() == []
    strict = {"wheels": {"pydantic": {"version": "2.14.4", "requires": ["typing-extensions>=99", "not-there>=1",
                                                                       "pywin32>=1; sys_platform == 'win32'"]}}}
    problems = gpu_wheels.installed_problems(strict)
    assert problems[0] == "pydantic 2.14.4 requires typing-extensions>=99: " \
        f"{__import__('importlib.metadata').metadata.version('typing-extensions')} is installed"
    assert problems[1:] == ["pydantic 2.14.4 requires not-there>=1: not installed"]


def test_an_earlier_set_is_replaced_and_nothing_else_in_its_folder_deleted(gpu_wheels, tmp_path):
    """--dest: the wheels an earlier run's manifest lists are this script's to delete; a wheel or dotfile of someone
    else's is refused in one line before anything is downloaded, and left where it is."""
    dest = tmp_path / "whl"
    dest.mkdir()
    (dest / "peft-0.21.2-py3-none-any.whl").write_bytes(b"earlier")
    (dest / "manifest.json").write_text(json.dumps({"wheels": {"peft": {"file": "peft-0.21.2-py3-none-any.whl"}}}))
    ours, strangers = gpu_wheels.earlier_set(dest)
    assert [path.name for path in ours] == ["peft-0.21.2-py3-none-any.whl", "manifest.json"] and strangers == []
    (dest / "mine-1.0-py3-none-any.whl").write_bytes(b"a user's own")
    (dest / ".keep").write_text("")
    assert gpu_wheels.earlier_set(dest)[1] == [".keep", "mine-1.0-py3-none-any.whl"]
    assert gpu_wheels.main(["--dest", str(dest)]) == 2
    assert sorted(path.name for path in dest.iterdir()) == [
        ".keep", "manifest.json", "mine-1.0-py3-none-any.whl", "peft-0.21.2-py3-none-any.whl"]
    assert gpu_wheels.earlier_set(tmp_path / "missing") == ([], [])
