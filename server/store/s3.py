"""S3-compatible stores through boto3: every object under s3://bucket/prefix/
is a file of the model folder, named by the rest of its key.

The endpoint, region and addressing style come from the store's settings,
else boto3's own (AWS_ENDPOINT_URL, AWS_REGION, ~/.aws/config); credentials
are boto3's standard chain (AWS_ACCESS_KEY_ID..., AWS_SHARED_CREDENTIALS_FILE,
instance roles). A whole-object ETag (no '-') is the object's MD5 and is
checked after the download.
"""

from __future__ import annotations

import hashlib
import threading
from dataclasses import dataclass
from typing import Iterator

from modeld.backends.errors import FailedPrecondition, InvalidArgument, NotFound, Unavailable

from .cache import MAX_FILES, Listing, RemoteFile, TransferBroken, safe_path
from .uri import SourceURI


@dataclass(frozen=True)
class S3Settings:
    endpoint: str = ""  # e.g. http://127.0.0.1:9000 for MinIO; empty: boto3's default (AWS_ENDPOINT_URL)
    region: str = ""
    addressing_style: str = "auto"  # path | virtual | auto


class S3Source:
    def __init__(self, settings: S3Settings) -> None:
        self.settings = settings
        self._client = None
        self._lock = threading.Lock()

    def client(self):
        with self._lock:
            if self._client is None:
                import boto3
                from botocore.config import Config

                self._client = boto3.session.Session().client(
                    "s3", endpoint_url=self.settings.endpoint or None, region_name=self.settings.region or None,
                    config=Config(s3={"addressing_style": self.settings.addressing_style},
                                  retries={"max_attempts": 3, "mode": "standard"}, connect_timeout=10,
                                  read_timeout=60))
            return self._client

    def listing(self, uri: SourceURI) -> Listing:
        from botocore.exceptions import BotoCoreError, ClientError, NoCredentialsError

        bucket, prefix = uri.reference, uri.path
        client = self.client()
        objects = []
        try:
            for page in client.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix):
                for obj in page.get("Contents", []):
                    if obj["Key"].endswith("/"):
                        continue  # a folder marker some tools write
                    objects.append(obj)
                    if len(objects) > MAX_FILES:
                        raise InvalidArgument(f"{uri.text} holds more than {MAX_FILES} objects; a model may have "
                                              f"at most {MAX_FILES} files")
        except NoCredentialsError:
            raise FailedPrecondition(f"{uri.text}: no S3 credentials; set AWS_ACCESS_KEY_ID and "
                                     "AWS_SECRET_ACCESS_KEY or a credentials file for the daemon") from None
        except ClientError as exc:
            raise _client_error(uri, exc) from None
        except BotoCoreError as exc:
            raise Unavailable(f"{uri.text}: the S3 store cannot be reached ({type(exc).__name__})") from None
        if not objects:
            raise NotFound(f"{uri.text}: no objects under that prefix")
        files = []
        for obj in objects:
            rel = safe_path(obj["Key"][len(prefix):], uri.text)
            etag = str(obj.get("ETag", "")).strip('"')
            md5 = etag if len(etag) == 32 and "-" not in etag else None
            files.append(RemoteFile(rel, int(obj["Size"]), None, self._fetch(uri, bucket, obj["Key"], etag),
                                    f"object {obj['Key'][:200]}", check_md5=md5))
        identity = hashlib.sha256("\n".join(f"{f.path}\0{o.get('ETag', '')}\0{o['Size']}"
                                            for f, o in zip(files, objects)).encode()).hexdigest()
        return Listing(uri.text, f"s3:{bucket}/{prefix}:{identity}", tuple(files))

    def _fetch(self, uri: SourceURI, bucket: str, key: str, etag: str):
        def fetch(offset: int) -> tuple[Iterator[bytes], int]:
            from botocore.exceptions import BotoCoreError, ClientError

            kwargs = {"Bucket": bucket, "Key": key}
            if etag:
                kwargs["IfMatch"] = f'"{etag}"'  # an object replaced mid-pull fails rather than mixes
            if offset:
                kwargs["Range"] = f"bytes={offset}-"
            try:
                answer = self.client().get_object(**kwargs)
            except ClientError as exc:
                raise _client_error(uri, exc) from None
            except BotoCoreError as exc:
                raise TransferBroken(type(exc).__name__) from None
            start = offset if answer.get("ContentRange") else 0
            return _chunks(answer["Body"]), start
        return fetch


def _chunks(body) -> Iterator[bytes]:
    from botocore.exceptions import BotoCoreError

    try:
        yield from body.iter_chunks(64 * 1024)  # small reads: a drop loses less
    except (BotoCoreError, OSError) as exc:
        raise TransferBroken(type(exc).__name__) from None
    finally:
        body.close()


def _client_error(uri: SourceURI, exc) -> Exception:
    code = str(exc.response.get("Error", {}).get("Code", ""))
    status = exc.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    if code in ("NoSuchBucket", "NoSuchKey", "404") or status == 404:
        return NotFound(f"{uri.text}: the S3 store has no such bucket or object ({code})")
    if code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch", "403") or status in (401, 403):
        return FailedPrecondition(f"{uri.text}: the S3 store refused the daemon's credentials ({code})")
    if code == "PreconditionFailed" or status == 412:
        return Unavailable(f"{uri.text}: an object changed during the pull; try again")
    return Unavailable(f"{uri.text}: the S3 store answered {code or status}; try again later")
