"""The redactor (plans/redaction.py) hides every kind of secret the issue names (issue 43,
finding 5): userinfo in any URL, secrets holding '/', '+' and '=' included; credential-shaped
parameters (S3 presigned URLs, Azure SAS tokens and connection strings); and every credential
value of the environment or of the command line, whole, percent-encoded or cut at a '/'."""
import pytest

from rayshard.plans.redaction import Redactor, carries_credentials, environment_secrets

SECRETS = ["wJalr/XUtnFEMI+K7MDENG=bPxRfiCYEXAMPLEKEY", "ab/cd/ef+gh==", "++//==++//==", "plain-secret-0123"]


@pytest.mark.parametrize("secret", SECRETS)
def test_userinfo_is_hidden_whatever_the_secret_holds(secret):
    redact = Redactor().redact
    for text in (f"s3://AKIAKEY:{secret}@bucket/runs", f"error at http://user:{secret}@minio:9000/x, retrying",
                 f'Invalid bucket name "AKIAKEY:{secret}@bucket"'):
        shown = redact(text)
        assert secret not in shown and "AKIAKEY" not in shown and "***@" in shown, shown


@pytest.mark.parametrize("text, secret", [
    ("https://b.s3.amazonaws.com/k?X-Amz-Algorithm=AWS4&X-Amz-Credential=AKIAQ%2F20240101%2Fus-east-1&X-Amz-Signature=abc123def",
     "abc123def"),
    ("https://acct.blob.core.windows.net/c/b?sv=2022-11-02&se=2030-01-01&sr=b&sp=r&sig=aB%2Bc%2Fd%3D", "aB%2Bc%2Fd%3D"),
    ("DefaultEndpointsProtocol=https;AccountName=acct;AccountKey=Zm9v/YmFy+YmF6==;EndpointSuffix=core.windows.net",
     "Zm9v/YmFy+YmF6=="),
    ("Authorization: AWS4-HMAC-SHA256 Credential=AKIAQEXAMPLE/20240101/us-east-1/s3/aws4_request, Signature=f00dbeef",
     "f00dbeef"),
    ("connect?token=t0k3n/+=x&password=hunter2/+=&access_key=AKIAQEXAMPLE", "hunter2/+="),
])
def test_credential_parameters_are_hidden(text, secret):
    shown = Redactor().redact(text)
    assert secret not in shown and "AKIAQ" not in shown and "t0k3n" not in shown, shown


def test_environment_secrets_are_hidden_wherever_they_show():
    environ = {"AWS_ACCESS_KEY_ID": "AKIAENVEXAMPLE123456", "AWS_SECRET_ACCESS_KEY": "env/Sec+ret=Value0123",
               "AWS_SESSION_TOKEN": "FwoGZXIvYXdzE/+token==", "AWS_DEFAULT_REGION": "us-east-1",
               "AZURE_STORAGE_CONNECTION_STRING": "AccountName=acct;AccountKey=YWJj/ZGVm+Z2hp==;EndpointSuffix=x",
               "AZURE_STORAGE_SAS_TOKEN": "sv=2022&sig=c2Fz%2Bsig"}
    redact = Redactor.for_process(environ).redact
    for secret in ("AKIAENVEXAMPLE123456", "env/Sec+ret=Value0123", "FwoGZXIvYXdzE/+token==", "YWJj/ZGVm+Z2hp=="):
        for shown in (redact(f"signing with {secret}."), redact(f"key={secret!r}"),
                      redact("url " + secret.replace("/", "%2F").replace("+", "%2B").replace("=", "%3D"))):
            assert secret not in shown and "%2F" not in shown.split("url ")[-1][:3], shown
    assert "us-east-1" in redact("region us-east-1")  # not a secret
    assert "YWJj/ZGVm+Z2hp==" in environment_secrets(environ)


def test_secrets_of_the_command_line_are_hidden_cut_at_a_slash():
    """s3fs splits s3://key:se/cret@bucket at its first '/' and botocore prints the head as a bucket."""
    redact = Redactor.for_process({}, ["plan", "schedule", "--costs-from", "s3://AKIAURLKEY:head+Sec/tail=Value@bkt/r"]).redact
    shown = redact('Invalid bucket name "AKIAURLKEY:head+Sec": Bucket name must match')
    assert "AKIAURLKEY" not in shown and "head+Sec" not in shown, shown
    assert "tail=Value" not in redact("key tail=Value@bkt/r")


@pytest.mark.parametrize("url, carries", [
    ("s3://AKIA:se/cr+et=@bucket/runs", True), ("s3://AKIA@bucket/runs", True), ("AKIA:se/cret@bucket/runs", True),
    ("s3://bucket/runs?X-Amz-Signature=abc", True), ("https://acct.blob.core.windows.net/c?sv=1&sig=x", True),
    ("s3://bucket/runs", False), ("s3://bucket/runs/r@5", False), ("./runs", False), ("/data/runs:v2", False),
    ("file:///tmp/runs", False), ("memory://store", False),
])
def test_a_url_carrying_credentials_is_recognised(url, carries):
    assert carries_credentials(url) is carries


def test_the_cli_output_stream_sees_a_secret_written_in_pieces():
    """What main prints passes a RedactingStream (cluster/cli/redacted_output.py): a progress bar
    redrawn with '\\r', a traceback written line by line, a secret split over two writes."""
    import io

    from rayshard.cluster.cli.redacted_output import RedactingStream

    secret = "wJalr/XUtnFEMI+K7MDENG=bPxRfiCY"
    target = io.StringIO()
    stream = RedactingStream(target, Redactor([secret]))
    stream.write("verify 10% signing with wJalr/XUt")
    stream.write("nFEMI+K7MDENG=bPxRfiCY\r")
    stream.write("done https://user:" + secret + "@host/x\n")
    stream.write("partial line " + secret)
    stream.flush()
    shown = target.getvalue()
    assert secret not in shown and "wJalr" not in shown and shown.count("***") == 3, shown
    assert shown.startswith("verify 10% signing with ***\r") and shown.endswith("partial line ***")
