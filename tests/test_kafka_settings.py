"""Kafka security settings: what the HALFWAY_KAFKA_* variables make of aiokafka's arguments,
which combinations fail at start and how, and that no password shows in a repr or an error."""

from __future__ import annotations

import json
import ssl
from pathlib import Path

import certifi
import pytest

from halfway.settings import KafkaSecurityError, KafkaSettings, kafka_security

SECRET = "s3cret-not-for-logs"
ALL_ENV = ("HALFWAY_KAFKA_SECURITY_PROTOCOL", "HALFWAY_KAFKA_SASL_MECHANISM",
           "HALFWAY_KAFKA_USERNAME", "HALFWAY_KAFKA_PASSWORD", "HALFWAY_KAFKA_PASSWORD_FILE",
           "HALFWAY_KAFKA_SSL_CAFILE", "HALFWAY_KAFKA_SSL_CERTFILE", "HALFWAY_KAFKA_SSL_KEYFILE",
           "HALFWAY_KAFKA_BOOTSTRAP", "HALFWAY_KAFKA_PORT")


@pytest.fixture(autouse=True)
def clean(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ALL_ENV:
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HALFWAY_HOME", str(tmp_path / "home"))  # no dev credentials there


def fails(match: str) -> pytest.RaisesContext[KafkaSecurityError]:
    return pytest.raises(KafkaSecurityError, match=match)


def test_nothing_set_and_no_dev_broker_credentials_is_plaintext() -> None:
    assert kafka_security("decider") == {}
    assert KafkaSettings.from_env().client() == {"bootstrap_servers": "127.0.0.1:19092"}


def test_scram_over_sasl_ssl_as_aiokafka_takes_it(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HALFWAY_KAFKA_SECURITY_PROTOCOL", "sasl_ssl")
    monkeypatch.setenv("HALFWAY_KAFKA_USERNAME", "decider")
    monkeypatch.setenv("HALFWAY_KAFKA_PASSWORD", SECRET)
    monkeypatch.setenv("HALFWAY_KAFKA_SSL_CAFILE", certifi.where())
    settings = KafkaSettings.from_env("decider")
    client = settings.client()
    assert client["security_protocol"] == "SASL_SSL"
    assert client["sasl_mechanism"] == "SCRAM-SHA-512"
    assert (client["sasl_plain_username"], client["sasl_plain_password"]) == ("decider", SECRET)
    assert isinstance(client["ssl_context"], ssl.SSLContext)
    assert settings.principal == "decider"
    assert SECRET not in repr(settings)


def test_a_username_alone_means_sasl_plaintext_and_a_password_file_works(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    secret_file = tmp_path / "kafka-password"
    secret_file.write_text(SECRET + "\n")
    monkeypatch.setenv("HALFWAY_KAFKA_USERNAME", "executor")
    monkeypatch.setenv("HALFWAY_KAFKA_PASSWORD_FILE", str(secret_file))
    security = kafka_security("executor")
    assert security["security_protocol"] == "SASL_PLAINTEXT"
    assert security["sasl_plain_password"] == SECRET  # the file's newline is not the password


@pytest.mark.parametrize(("env", "match"), [
    ({"HALFWAY_KAFKA_SECURITY_PROTOCOL": "TLS"}, "one of PLAINTEXT, SSL"),
    ({"HALFWAY_KAFKA_SECURITY_PROTOCOL": "SASL_SSL", "HALFWAY_KAFKA_PASSWORD": SECRET},
     "SASL_SSL needs HALFWAY_KAFKA_USERNAME"),
    ({"HALFWAY_KAFKA_USERNAME": "a"}, "needs HALFWAY_KAFKA_PASSWORD or"),
    ({"HALFWAY_KAFKA_USERNAME": "a", "HALFWAY_KAFKA_PASSWORD": SECRET,
      "HALFWAY_KAFKA_PASSWORD_FILE": "/etc/hostname"}, "not both"),
    ({"HALFWAY_KAFKA_USERNAME": "a", "HALFWAY_KAFKA_PASSWORD": SECRET,
      "HALFWAY_KAFKA_SASL_MECHANISM": "GSSAPI"}, "SCRAM-SHA-512"),
    ({"HALFWAY_KAFKA_SECURITY_PROTOCOL": "PLAINTEXT", "HALFWAY_KAFKA_USERNAME": "a",
      "HALFWAY_KAFKA_PASSWORD": SECRET}, "use SASL_PLAINTEXT or SASL_SSL"),
    ({"HALFWAY_KAFKA_USERNAME": "a", "HALFWAY_KAFKA_PASSWORD": SECRET,
      "HALFWAY_KAFKA_SSL_CAFILE": "/x/ca.pem"}, "use SSL or SASL_SSL"),
    ({"HALFWAY_KAFKA_SECURITY_PROTOCOL": "SSL", "HALFWAY_KAFKA_SSL_KEYFILE": "/x/key.pem"},
     "KEYFILE needs HALFWAY_KAFKA_SSL_CERTFILE"),
    ({"HALFWAY_KAFKA_SECURITY_PROTOCOL": "SSL", "HALFWAY_KAFKA_SSL_CAFILE": "/x/ca.pem"},
     "CAFILE=/x/ca.pem: no such file"),
    ({"HALFWAY_KAFKA_USERNAME": "a", "HALFWAY_KAFKA_PASSWORD_FILE": "/x/none"},
     "PASSWORD_FILE=/x/none: No such file"),
])
def test_bad_combinations_fail_at_start_without_the_password(
        monkeypatch: pytest.MonkeyPatch, env: dict[str, str], match: str) -> None:
    for name, value in env.items():
        monkeypatch.setenv(name, value)
    with fails(match) as failed:
        KafkaSettings.from_env("caller")
    assert SECRET not in str(failed.value)


def test_the_dev_broker_gives_each_kind_its_own_principal(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    creds = tmp_path / "home" / "kafka" / "credentials.json"
    creds.parent.mkdir(parents=True)
    creds.write_text(json.dumps({"passwords": {"decider": "d-pw", "caller": "c-pw"}}))
    assert kafka_security("decider")["sasl_plain_username"] == "decider"
    assert kafka_security("caller")["sasl_plain_password"] == "c-pw"
    with fails("no password for executor"):
        kafka_security("executor")
    with fails("no Kafka principal kind 'root'"):
        kafka_security("root")
    # Explicit variables always win over the file.
    monkeypatch.setenv("HALFWAY_KAFKA_USERNAME", "ops")
    monkeypatch.setenv("HALFWAY_KAFKA_PASSWORD", SECRET)
    assert kafka_security("decider")["sasl_plain_username"] == "ops"
    monkeypatch.delenv("HALFWAY_KAFKA_USERNAME")
    monkeypatch.delenv("HALFWAY_KAFKA_PASSWORD")
    # Another broker than the local one gets none of the dev passwords.
    monkeypatch.setenv("HALFWAY_KAFKA_BOOTSTRAP", "broker.example:9092")
    assert kafka_security("decider") == {}
