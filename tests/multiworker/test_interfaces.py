"""Which interface a multi-machine job talks on (``stratagem.comm.interfaces``): the rules, on
this machine's own interfaces. Across real hosts: tests/net/test_across_hosts.py."""

from __future__ import annotations

import os

import pytest

from stratagem.comm import interfaces


def _a_real_address() -> tuple[str, str] | None:
    for name, addrs in interfaces.addresses().items():
        for a in addrs:
            if not a.startswith("127."):
                return name, a
    return None


def test_loopback_rendezvous_leaves_the_environment_alone(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interfaces.pin("127.0.0.1", "127.0.0.1", 29400, rank=0) is None
    assert interfaces.pin(None, "localhost", 29400, rank=0) is None
    assert "GLOO_SOCKET_IFNAME" not in os.environ


def test_the_interface_holding_this_tasks_address_is_chosen_and_set(monkeypatch):
    real = _a_real_address()
    if real is None:
        pytest.skip("this machine has no address but loopback")
    name, address = real
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    monkeypatch.delenv("NCCL_SOCKET_IFNAME", raising=False)
    chosen, addr, why = interfaces.choose(address, address, 29400)
    assert (chosen, addr) == (name, address) and address in why
    assert interfaces.pin(address, address, 29400, rank=0, variables=(interfaces.GLOO, interfaces.NCCL)) == name
    assert os.environ["GLOO_SOCKET_IFNAME"] == name and os.environ["NCCL_SOCKET_IFNAME"] == name


def test_a_variable_the_user_set_is_kept(monkeypatch):
    real = _a_real_address()
    if real is None:
        pytest.skip("this machine has no address but loopback")
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "my-choice")
    assert interfaces.pin(real[1], real[1], 29400, rank=0) is None
    assert os.environ["GLOO_SOCKET_IFNAME"] == "my-choice"


def test_a_hostname_resolving_to_loopback_falls_back_to_the_route_to_the_rendezvous():
    real = _a_real_address()
    if real is None:
        pytest.skip("this machine has no address but loopback")
    # "localhost" stands for a Debian/Ubuntu hostname that resolves to 127.0.1.1
    chosen, addr, why = interfaces.choose("localhost", real[1], 29400)
    assert (chosen, addr) == real and "reaches the rendezvous" in why


def test_an_address_no_interface_holds_is_an_error_naming_it():
    with pytest.raises(interfaces.InterfaceError, match=r"names 10\.254\.254\.254 as this task's address"):
        interfaces.choose("10.254.254.254", "127.0.0.1", 29400)
