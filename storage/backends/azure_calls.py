"""Every Blob REST operation rayshard makes on Azure, the code path that makes it, and the Azure
RBAC permission it needs.

deploy/azure-blob-role.json is a custom role granting exactly these permissions, no more and no
fewer (tests/unit/test_azure_calls.py derives them from this list, and checks that every Blob SDK
method `azure.py` calls itself is listed here). Operations marked "through adlfs" are what the
named fsspec call sends with the adlfs version rayshard pins; the others are named in rayshard's
own code. Add an operation here when the code starts making it, and the role follows. The
built-in "Storage Blob Data Contributor" role on the container also covers them, with container
create and delete besides.
"""

READ_BLOBS = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs/read"
WRITE_BLOBS = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs/write"
DELETE_BLOBS = "Microsoft.Storage/storageAccounts/blobServices/containers/blobs/delete"
READ_CONTAINER = "Microsoft.Storage/storageAccounts/blobServices/containers/read"  # an Action, not a DataAction

# (REST operation, the azure-storage-blob method that sends it, the permission)
AZURE_OPERATIONS = (
    # fs.ls / fs.find / fs.isdir / fs.exists on a prefix, through adlfs: Store.runs and
    # Store.steps, Catalog, leases.all_leases, retention's fs.rm(recursive=True); and directly:
    # azure._uncommitted_blobs (AzureBackend.pending_uploads, with include=uncommittedblobs).
    ("List Blobs", "list_blobs", READ_BLOBS),
    # fs.exists / fs.info on a blob, through adlfs: Store.latest_step, Store.read_text, Catalog,
    # leases, retention.
    ("Get Blob Properties", "get_blob_properties", READ_BLOBS),
    # fs.makedirs probes the container before writing under it, through adlfs: Store.write_text,
    # leases.acquire. (Refused, adlfs assumes the container exists and goes on.)
    ("Get Container Properties", "get_container_properties", READ_CONTAINER),
    # fs.cat_file / fs._cat_file (ranged GETs), through adlfs: storage/ranged_fetch.py, Store,
    # Catalog; and directly: azure._get_with_etag (AzureBackend.read_versioned, LATEST's CAS).
    ("Get Blob", "download_blob", READ_BLOBS),
    # fs.pipe_file, through adlfs: Store.write_text, leases.acquire, AzureBackend.replace; and
    # directly: AzureBackend.create_only (If-None-Match: *), AzureBackend.replace_if (If-Match:
    # ETag), BlockBlobWriter's single-request objects.
    ("Put Blob", "upload_blob", WRITE_BLOBS),
    # azure.BlockBlobWriter: objects larger than the upload budget, staged and committed.
    ("Put Block", "stage_block", WRITE_BLOBS),
    # BlockBlobWriter's commit; and azure._discard_uncommitted (a failed save's abort,
    # AzureBackend.abort_upload for ckpt gc): an empty block list discards uncommitted blocks.
    ("Put Block List", "commit_block_list", WRITE_BLOBS),
    # fs.rm_file / fs.rm(recursive=True), through adlfs: retention, leases.release; and directly:
    # azure._discard_uncommitted removes the empty blob its Put Block List made.
    ("Delete Blob", "delete_blob", DELETE_BLOBS),
)
