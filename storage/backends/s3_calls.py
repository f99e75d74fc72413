"""Every S3 API operation rayshard makes, and the code path that makes it.

deploy/s3-iam-policy.json grants exactly the IAM actions these operations need, no more and no
fewer (tests/unit/test_deploy_manifests.py derives them from this list). Operations marked
"through s3fs" are what the named fsspec call sends with the s3fs version rayshard pins; the
others are named in rayshard's own code (`_call_s3` / `call_s3`), which the test also scans, so
a new direct call that is missing here fails it. Add an operation here when the code starts
making it, and the policy follows.
"""

S3_OPERATIONS = (
    # fs.ls / fs.find / fs.isdir and the directory fallback of fs.exists, through s3fs:
    # Store.runs and Store.steps, Catalog (cluster/catalog/catalog.py), leases.all_leases, and
    # the key listing behind retention's fs.rm(recursive=True).
    "ListObjectsV2",
    # fs.exists / fs.info on a key, through s3fs: Store.latest_step, Store.read_text,
    # Catalog, leases, retention (cluster/catalog/store.py, catalog.py, leases.py, retention.py).
    "HeadObject",
    # fs.makedirs probes the bucket before writing under it, through s3fs: Store.write_text,
    # leases.acquire; and directly: S3Backend.missing_container (train, ckpt ls and gc check the
    # bucket exists before anything else).
    "HeadBucket",
    # fs.cat_file / fs.cat / fs.cat_ranges / fs._cat_file (ranged GETs), through s3fs:
    # storage/ranged_fetch.py, Store, Catalog; and directly:
    # storage/backends/s3.py _get_with_etag (S3Backend.read_versioned, the LATEST compare-and-swap).
    "GetObject",
    # fs.pipe_file, through s3fs, including conditional writes: object_store.create_only
    # (If-None-Match: *), object_store.replace_if (If-Match: ETag), Store.write_text,
    # leases.acquire; and directly: storage/backends/s3_multipart.py's single-PUT objects.
    "PutObject",
    # storage/backends/s3_multipart.py MultipartWriter, shards larger than the upload budget.
    "CreateMultipartUpload",
    "UploadPart",
    "CompleteMultipartUpload",
    # s3_multipart.MultipartWriter.abort (a failed save) and S3Backend.abort_upload (ckpt gc).
    "AbortMultipartUpload",
    # S3Backend.pending_uploads: ckpt gc finds uploads a dead process left behind.
    "ListMultipartUploads",
    # fs.rm_file, through s3fs: retention (manifest first, expired leases), leases.release.
    "DeleteObject",
    # fs.rm(recursive=True), through s3fs: retention removes a checkpoint's or a leftover's objects.
    "DeleteObjects",
)
