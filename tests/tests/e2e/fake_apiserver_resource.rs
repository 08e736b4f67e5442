//! The fake API server's `resource.k8s.io/v1` (what a DRA kubelet plugin uses), over plain HTTP
//! and through kube-rs with k8s-openapi's types: ResourceSlices created, listed by field,
//! watched, updated, validated and deleted as the real server does them; ResourceClaims and
//! DeviceClasses served as the test put them.

use std::collections::BTreeMap;

use anyhow::{Context as _, Result};
use baleen_tests::fake_apiserver::FakeApiServer;
use baleen_tests::http::request;
use futures::StreamExt as _;
use k8s_openapi::api::resource::v1::{
    Device, DeviceAttribute, DeviceCapacity, DeviceClass, ResourceClaim, ResourcePool,
    ResourceSlice, ResourceSliceSpec,
};
use k8s_openapi::apimachinery::pkg::api::resource::Quantity;
use k8s_openapi::apimachinery::pkg::apis::meta::v1::ObjectMeta;
use kube::api::{Api, DeleteParams, ListParams, PostParams, WatchEvent, WatchParams};
use serde_json::{Value, json};

use crate::support::WAIT;

const SLICES: &str = "/apis/resource.k8s.io/v1/resourceslices";
const DRIVER: &str = "gpu.awesome-ai-company.com";

/// `method path` with `body` (`Null`: none) over plain HTTP: the status code and the JSON
/// answer.
async fn call(api: &FakeApiServer, method: &str, path: &str, body: &Value) -> Result<(u16, Value)> {
    let text = if body.is_null() { String::new() } else { body.to_string() };
    let (code, answer) = tokio::time::timeout(WAIT, request(api.address(), method, path, &text))
        .await
        .with_context(|| format!("{method} {path} timed out"))??;
    let answer =
        serde_json::from_str(&answer).with_context(|| format!("{method} {path}: {answer}"))?;
    Ok((code, answer))
}

/// A slice of `node`'s pool with `devices` GPUs, as a kubelet plugin publishes it.
fn slice(name: &str, node: &str, devices: usize) -> Value {
    let devices: Vec<Value> = (0..devices)
        .map(|i| {
            json!({
                "name": format!("gpu-{i}"),
                "attributes": {"index": {"int": i}, "uuid": {"string": format!("GPU-{node}-{i}")}},
                "capacity": {"memory": {"value": "141Gi"}}
            })
        })
        .collect();
    json!({
        "apiVersion": "resource.k8s.io/v1", "kind": "ResourceSlice",
        "metadata": {"name": name},
        "spec": {
            "driver": DRIVER, "nodeName": node,
            "pool": {"name": node, "generation": 1, "resourceSliceCount": 1},
            "devices": devices
        }
    })
}

/// Creates `body` over HTTP; the slice as stored.
async fn create(api: &FakeApiServer, body: &Value) -> Result<Value> {
    let (code, created) = call(api, "POST", SLICES, body).await?;
    anyhow::ensure!(code == 201, "create answered {code}: {created}");
    Ok(created)
}

fn names(list: &Value) -> Vec<&str> {
    list["items"]
        .as_array()
        .map(|items| items.iter().filter_map(|i| i["metadata"]["name"].as_str()).collect())
        .unwrap_or_default()
}

/// The `field`s and `reason`s of an `Invalid` Status's causes.
fn causes(status: &Value) -> Vec<(String, String)> {
    status["details"]["causes"]
        .as_array()
        .map(|causes| {
            causes
                .iter()
                .map(|c| {
                    let text = |k: &str| c[k].as_str().unwrap_or_default().to_owned();
                    (text("field"), text("reason"))
                })
                .collect()
        })
        .unwrap_or_default()
}

fn client(api: &FakeApiServer) -> Result<kube::Client> {
    Ok(kube::Client::try_from(kube::Config::new(api.url().parse()?))?)
}

/// The next event of a kube watch, within `WAIT`.
async fn next<K>(
    events: &mut (impl futures::Stream<Item = kube::Result<WatchEvent<K>>> + Unpin),
) -> Result<WatchEvent<K>> {
    tokio::time::timeout(WAIT, events.next())
        .await
        .context("no watch event in time")?
        .context("the watch ended")?
        .context("the watch failed")
}

fn event_name(event: &WatchEvent<ResourceSlice>) -> (&'static str, String, Option<i64>) {
    let (type_, slice) = match event {
        WatchEvent::Added(s) => ("ADDED", Some(s)),
        WatchEvent::Modified(s) => ("MODIFIED", Some(s)),
        WatchEvent::Deleted(s) => ("DELETED", Some(s)),
        WatchEvent::Bookmark(_) => ("BOOKMARK", None),
        WatchEvent::Error(_) => ("ERROR", None),
    };
    let name = slice.and_then(|s| s.metadata.name.clone()).unwrap_or_default();
    (type_, name, slice.and_then(|s| s.metadata.generation))
}

#[tokio::test]
async fn a_slice_created_with_generate_name_gets_a_name_uid_and_generation_one() -> Result<()> {
    let api = FakeApiServer::start(&["node-a"]).await?;
    let mut body = slice("", "node-a", 2);
    body["metadata"] = json!({"generateName": "node-a-gpu-"});
    let created = create(&api, &body).await?;

    let name = created["metadata"]["name"].as_str().context("a name")?;
    let suffix = name.strip_prefix("node-a-gpu-").context("the generateName prefix")?;
    assert_eq!(suffix.len(), 5, "{name}");
    assert!(suffix.bytes().all(|b| b.is_ascii_lowercase() || b.is_ascii_digit()), "{name}");
    assert_eq!(created["metadata"]["uid"].as_str().map(str::len), Some(36), "{created}");
    assert!(created["metadata"]["resourceVersion"].as_str().is_some_and(|v| !v.is_empty()));
    assert!(created["metadata"]["creationTimestamp"].as_str().is_some_and(|t| t.ends_with('Z')));
    assert_eq!(created["metadata"]["generation"], json!(1));
    assert_eq!(created["spec"], body["spec"]);
    assert_eq!(api.resource_slices(), vec![created.clone()]);

    let (code, got) = call(&api, "GET", &format!("{SLICES}/{name}"), &Value::Null).await?;
    assert_eq!((code, &got), (200, &created));
    // The same name again: 409 AlreadyExists, as the real server answers.
    let (code, refused) = call(&api, "POST", SLICES, &slice(name, "node-a", 1)).await?;
    assert_eq!(code, 409, "{refused}");
    assert_eq!(refused["reason"], json!("AlreadyExists"));
    assert_eq!(refused["kind"], json!("Status"));
    let (code, missing) = call(&api, "GET", &format!("{SLICES}/nope"), &Value::Null).await?;
    assert_eq!((code, &missing["reason"]), (404, &json!("NotFound")));
    Ok(())
}

#[tokio::test]
async fn slices_are_listed_by_node_driver_pool_and_name_and_other_fields_are_refused() -> Result<()>
{
    let api = FakeApiServer::start(&[]).await?;
    create(&api, &slice("a-gpu", "node-a", 1)).await?;
    let mut other = slice("a-nic", "node-a", 1);
    other["spec"]["driver"] = json!("nic.example.com");
    other["spec"]["pool"]["name"] = json!("node-a-nics");
    create(&api, &other).await?;
    create(&api, &slice("b-gpu", "node-b", 1)).await?;

    let list = |selector: &str| format!("{SLICES}?fieldSelector={selector}");
    let (code, all) = call(&api, "GET", SLICES, &Value::Null).await?;
    assert_eq!(code, 200);
    assert_eq!(all["kind"], json!("ResourceSliceList"));
    assert_eq!(all["apiVersion"], json!("resource.k8s.io/v1"));
    assert!(all["metadata"]["resourceVersion"].as_str().is_some_and(|v| !v.is_empty()), "{all}");
    assert_eq!(names(&all), ["a-gpu", "a-nic", "b-gpu"]);
    for (selector, expected) in [
        ("spec.nodeName%3Dnode-a", &["a-gpu", "a-nic"][..]),
        ("spec.driver%3D%3Dgpu.awesome-ai-company.com", &["a-gpu", "b-gpu"]),
        ("spec.nodeName%3Dnode-a%2Cspec.driver%3Dgpu.awesome-ai-company.com", &["a-gpu"]),
        ("spec.pool.name%3Dnode-a-nics", &["a-nic"]),
        ("metadata.name%3Db-gpu", &["b-gpu"]),
        ("spec.driver!%3Dgpu.awesome-ai-company.com", &["a-nic"]),
        ("spec.nodeName%3Dnode-c", &[]),
    ] {
        let (code, found) = call(&api, "GET", &list(selector), &Value::Null).await?;
        assert_eq!(code, 200, "{selector}: {found}");
        assert_eq!(names(&found), expected, "{selector}");
    }
    for refused in ["status.phase%3DReady", "spec.devices%3Dx", "spec.nodeName"] {
        let (code, answer) = call(&api, "GET", &list(refused), &Value::Null).await?;
        assert_eq!((code, &answer["reason"]), (400, &json!("BadRequest")), "{refused}");
    }
    Ok(())
}

#[tokio::test]
async fn a_watch_by_node_sees_its_slice_added_modified_and_deleted() -> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    let slices: Api<ResourceSlice> = Api::all(client(&api)?);
    let listed = tokio::time::timeout(WAIT, slices.list(&ListParams::default())).await??;
    let version = listed.metadata.resource_version.context("the list's resourceVersion")?;
    let params = WatchParams::default().fields("spec.nodeName=node-a").timeout(60);
    let mut events = tokio::time::timeout(WAIT, slices.watch(&params, &version)).await??.boxed();

    create(&api, &slice("b-gpu", "node-b", 1)).await?;
    let created = create(&api, &slice("a-gpu", "node-a", 1)).await?;
    let mut changed = created.clone();
    changed["spec"]["devices"] = slice("", "node-a", 2)["spec"]["devices"].clone();
    let (code, updated) = call(&api, "PUT", &format!("{SLICES}/a-gpu"), &changed).await?;
    assert_eq!(code, 200, "{updated}");
    let (code, deleted) = call(&api, "DELETE", &format!("{SLICES}/a-gpu"), &Value::Null).await?;
    assert_eq!(code, 200, "{deleted}");

    let mut seen = Vec::new();
    for _ in 0..3 {
        seen.push(event_name(&next(&mut events).await?));
    }
    let a = || "a-gpu".to_owned();
    assert_eq!(
        seen,
        [("ADDED", a(), Some(1)), ("MODIFIED", a(), Some(2)), ("DELETED", a(), Some(2))]
    );
    Ok(())
}

#[tokio::test]
async fn an_update_conflicts_on_a_stale_version_and_bumps_the_generation_on_a_spec_change()
-> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    let path = format!("{SLICES}/a-gpu");
    let created = create(&api, &slice("a-gpu", "node-a", 1)).await?;

    // A metadata-only change: written, the generation stays.
    let mut labelled = created.clone();
    labelled["metadata"]["labels"] = json!({"team": "a"});
    let (code, after_label) = call(&api, "PUT", &path, &labelled).await?;
    assert_eq!(code, 200, "{after_label}");
    assert_eq!(after_label["metadata"]["generation"], json!(1));
    assert_ne!(after_label["metadata"]["resourceVersion"], created["metadata"]["resourceVersion"]);
    assert_eq!(after_label["metadata"]["uid"], created["metadata"]["uid"]);

    // The version the first answer carried is stale now: 409 Conflict.
    let (code, refused) = call(&api, "PUT", &path, &created).await?;
    assert_eq!((code, &refused["reason"]), (409, &json!("Conflict")), "{refused}");
    assert!(
        refused["message"].as_str().is_some_and(|m| m.contains("the object has been modified"))
    );

    // A spec change without a version (an unconditional update): the generation goes up.
    let mut more = after_label.clone();
    more["metadata"].as_object_mut().context("metadata")?.remove("resourceVersion");
    more["spec"]["devices"] = slice("", "node-a", 3)["spec"]["devices"].clone();
    let (code, after_spec) = call(&api, "PUT", &path, &more).await?;
    assert_eq!(code, 200, "{after_spec}");
    assert_eq!(after_spec["metadata"]["generation"], json!(2));
    assert_eq!(
        after_spec["metadata"]["creationTimestamp"],
        created["metadata"]["creationTimestamp"]
    );

    // The same object again: nothing is written, the version stays.
    let (code, again) = call(&api, "PUT", &path, &after_spec).await?;
    assert_eq!((code, &again), (200, &after_spec));

    // The driver cannot change; an unknown slice is not found; the URL names the object.
    let mut moved = after_spec.clone();
    moved["spec"]["driver"] = json!("other.example.com");
    let (code, refused) = call(&api, "PUT", &path, &moved).await?;
    assert_eq!((code, &refused["reason"]), (422, &json!("Invalid")), "{refused}");
    assert_eq!(causes(&refused), [("spec.driver".to_owned(), "FieldValueInvalid".to_owned())]);
    let mut unknown = after_spec.clone();
    unknown["metadata"]["name"] = json!("nope");
    let (code, _) = call(&api, "PUT", &format!("{SLICES}/nope"), &unknown).await?;
    assert_eq!(code, 404);
    let (code, _) = call(&api, "PUT", &format!("{SLICES}/other"), &after_spec).await?;
    assert_eq!(code, 400);
    Ok(())
}

#[tokio::test]
async fn an_invalid_slice_is_refused_with_the_fields_named() -> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    let refused = async |body: &Value| -> Result<Vec<(String, String)>> {
        let (code, answer) = call(&api, "POST", SLICES, body).await?;
        anyhow::ensure!(code == 422, "answered {code}: {answer}");
        anyhow::ensure!(answer["reason"] == json!("Invalid"), "{answer}");
        anyhow::ensure!(answer["details"]["kind"] == json!("ResourceSlice"), "{answer}");
        Ok(causes(&answer))
    };
    let field = |f: &str, reason: &str| (f.to_owned(), reason.to_owned());

    assert_eq!(
        refused(&slice("too-many", "node-a", 129)).await?,
        [field("spec.devices", "FieldValueTooMany")]
    );
    create(&api, &slice("just-enough", "node-a", 128)).await?;

    let mut no_pool = slice("no-pool", "node-a", 1);
    no_pool["spec"].as_object_mut().context("spec")?.remove("pool");
    assert_eq!(
        refused(&no_pool).await?,
        [
            field("spec.pool.name", "FieldValueRequired"),
            field("spec.pool.resourceSliceCount", "FieldValueInvalid")
        ]
    );
    let mut no_count = slice("no-count", "node-a", 1);
    no_count["spec"]["pool"]["resourceSliceCount"] = json!(0);
    no_count["spec"]["pool"]["generation"] = json!(-1);
    assert_eq!(
        refused(&no_count).await?,
        [
            field("spec.pool.resourceSliceCount", "FieldValueInvalid"),
            field("spec.pool.generation", "FieldValueInvalid")
        ]
    );
    let mut no_driver = slice("no-driver", "node-a", 1);
    no_driver["spec"]["driver"] = json!("");
    assert_eq!(refused(&no_driver).await?, [field("spec.driver", "FieldValueRequired")]);

    let mut nowhere = slice("nowhere", "node-a", 1);
    nowhere["spec"].as_object_mut().context("spec")?.remove("nodeName");
    assert_eq!(refused(&nowhere).await?, [field("spec", "FieldValueRequired")]);
    let mut twice = slice("twice", "node-a", 1);
    twice["spec"]["allNodes"] = json!(true);
    assert_eq!(refused(&twice).await?, [field("spec", "FieldValueInvalid")]);
    let mut everywhere = slice("everywhere", "node-a", 1);
    everywhere["spec"].as_object_mut().context("spec")?.remove("nodeName");
    everywhere["spec"]["allNodes"] = json!(true);
    create(&api, &everywhere).await?;

    let mut duplicate = slice("duplicate", "node-a", 2);
    duplicate["spec"]["devices"][1]["name"] = json!("gpu-0");
    assert_eq!(refused(&duplicate).await?, [field("spec.devices[1]", "FieldValueDuplicate")]);
    let mut unnamed = slice("unnamed", "node-a", 1);
    unnamed["spec"]["devices"][0]["name"] = json!("GPU 0");
    assert_eq!(refused(&unnamed).await?, [field("spec.devices[0].name", "FieldValueInvalid")]);

    let mut nameless = slice("", "node-a", 1);
    nameless["metadata"] = json!({});
    assert_eq!(refused(&nameless).await?, [field("metadata.name", "FieldValueRequired")]);

    let stored: Vec<Value> = api.resource_slices();
    assert_eq!(
        stored.iter().filter_map(|s| s["metadata"]["name"].as_str()).collect::<Vec<_>>(),
        ["everywhere", "just-enough"]
    );
    Ok(())
}

#[tokio::test]
async fn deletecollection_deletes_what_the_selector_matches_and_delete_checks_preconditions()
-> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    for (name, node) in [("a-0", "node-a"), ("a-1", "node-a"), ("b-0", "node-b")] {
        create(&api, &slice(name, node, 1)).await?;
    }
    let path = format!("{SLICES}?fieldSelector=spec.nodeName%3Dnode-a");
    let (code, deleted) = call(&api, "DELETE", &path, &json!({})).await?;
    assert_eq!(code, 200, "{deleted}");
    assert_eq!(deleted["kind"], json!("ResourceSliceList"));
    assert_eq!(names(&deleted), ["a-0", "a-1"]);
    let left = api.resource_slices();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["metadata"]["name"], json!("b-0"));
    let (code, _) =
        call(&api, "DELETE", &format!("{SLICES}?fieldSelector=spec.foo%3Dx"), &json!({})).await?;
    assert_eq!(code, 400);

    let one = format!("{SLICES}/b-0");
    let wrong = json!({"preconditions": {"uid": "not-its-uid"}});
    let (code, refused) = call(&api, "DELETE", &one, &wrong).await?;
    assert_eq!((code, &refused["reason"]), (409, &json!("Conflict")), "{refused}");
    let right = json!({"preconditions": {"uid": left[0]["metadata"]["uid"]}});
    let (code, gone) = call(&api, "DELETE", &one, &right).await?;
    assert_eq!((code, &gone["metadata"]["name"]), (200, &json!("b-0")), "{gone}");
    let (code, _) = call(&api, "GET", &one, &Value::Null).await?;
    assert_eq!(code, 404);
    let (code, _) = call(&api, "DELETE", &one, &Value::Null).await?;
    assert_eq!(code, 404);
    assert!(api.resource_slices().is_empty());
    Ok(())
}

#[tokio::test]
async fn a_kubelet_start_deletes_its_nodes_slices_and_watchers_see_them_go() -> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    for (name, node) in [("a-0", "node-a"), ("a-1", "node-a"), ("b-0", "node-b")] {
        create(&api, &slice(name, node, 1)).await?;
    }
    let slices: Api<ResourceSlice> = Api::all(client(&api)?);
    let listed = tokio::time::timeout(WAIT, slices.list(&ListParams::default())).await??;
    let version = listed.metadata.resource_version.context("the list's resourceVersion")?;
    let params = WatchParams::default().timeout(60);
    let mut events = tokio::time::timeout(WAIT, slices.watch(&params, &version)).await??.boxed();

    assert_eq!(api.delete_resource_slices_of_node("node-a"), 2);
    let first = event_name(&next(&mut events).await?);
    let second = event_name(&next(&mut events).await?);
    assert_eq!(
        [first, second],
        [("DELETED", "a-0".to_owned(), Some(1)), ("DELETED", "a-1".to_owned(), Some(1))]
    );
    let left = api.resource_slices();
    assert_eq!(left.len(), 1);
    assert_eq!(left[0]["metadata"]["name"], json!("b-0"));
    assert_eq!(api.delete_resource_slices_of_node("node-a"), 0);
    Ok(())
}

#[tokio::test]
async fn a_claim_is_served_as_put_and_a_missing_one_is_not_found() -> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    let path = "/apis/resource.k8s.io/v1/namespaces/team-a/resourceclaims/train-gpu";
    let put = api.put_resource_claim(json!({
        "metadata": {"name": "train-gpu", "namespace": "team-a"},
        "spec": {"devices": {"requests": [{"name": "gpu", "exactly": {"deviceClassName": "gpu.awesome-ai-company.com"}}]}},
        "status": {
            "allocation": {"devices": {"results": [{
                "request": "gpu", "driver": DRIVER, "pool": "node-a", "device": "gpu-0",
                "consumedCapacity": {"memory": "10Gi"},
                "shareID": "9b2c1c7e-51b9-4f2e-9b43-3b8f8d2f1c11"
            }]}},
            "reservedFor": [{"resource": "pods", "name": "train", "uid": "uid-train"}]
        }
    }));
    assert_eq!(put["metadata"]["uid"].as_str().map(str::len), Some(36), "{put}");
    assert!(put["metadata"]["resourceVersion"].as_str().is_some());
    assert_eq!(put["kind"], json!("ResourceClaim"));

    let (code, got) = call(&api, "GET", path, &Value::Null).await?;
    assert_eq!((code, &got), (200, &put));
    // What kube-rs reads of it: the allocation a kubelet plugin prepares.
    let claims: Api<ResourceClaim> = Api::namespaced(client(&api)?, "team-a");
    let claim = tokio::time::timeout(WAIT, claims.get("train-gpu")).await??;
    let status = claim.status.context("a status")?;
    let results = status.allocation.and_then(|a| a.devices).and_then(|d| d.results);
    let result = results.as_deref().and_then(<[_]>::first).context("a result")?;
    assert_eq!((result.device.as_str(), result.pool.as_str()), ("gpu-0", "node-a"));
    assert_eq!(result.share_id.as_deref(), Some("9b2c1c7e-51b9-4f2e-9b43-3b8f8d2f1c11"));
    assert_eq!(
        result.consumed_capacity.as_ref().and_then(|c| c.get("memory")),
        Some(&Quantity("10Gi".into()))
    );
    assert_eq!(status.reserved_for.map(|r| r.len()), Some(1));

    let (code, missing) = call(
        &api,
        "GET",
        "/apis/resource.k8s.io/v1/namespaces/team-b/resourceclaims/train-gpu",
        &Value::Null,
    )
    .await?;
    assert_eq!((code, &missing["reason"]), (404, &json!("NotFound")), "{missing}");
    api.delete_resource_claim("team-a", "train-gpu");
    let (code, _) = call(&api, "GET", path, &Value::Null).await?;
    assert_eq!(code, 404);
    Ok(())
}

#[tokio::test]
async fn device_classes_are_listed_and_got() -> Result<()> {
    let api = FakeApiServer::start(&[]).await?;
    for name in ["gpu.awesome-ai-company.com", "mig.awesome-ai-company.com"] {
        api.put_device_class(json!({
            "metadata": {"name": name},
            "spec": {"selectors": [{"cel": {"expression": format!("device.driver == '{DRIVER}'")}}]}
        }));
    }
    let (code, list) =
        call(&api, "GET", "/apis/resource.k8s.io/v1/deviceclasses", &Value::Null).await?;
    assert_eq!(code, 200, "{list}");
    assert_eq!(list["kind"], json!("DeviceClassList"));
    assert_eq!(names(&list), ["gpu.awesome-ai-company.com", "mig.awesome-ai-company.com"]);
    let one = "/apis/resource.k8s.io/v1/deviceclasses/gpu.awesome-ai-company.com";
    let (code, got) = call(&api, "GET", one, &Value::Null).await?;
    assert_eq!((code, &got["metadata"]["name"]), (200, &json!("gpu.awesome-ai-company.com")));
    let (code, _) =
        call(&api, "GET", "/apis/resource.k8s.io/v1/deviceclasses/nope", &Value::Null).await?;
    assert_eq!(code, 404);

    let classes: Api<DeviceClass> = Api::all(client(&api)?);
    let listed = tokio::time::timeout(WAIT, classes.list(&ListParams::default())).await??;
    assert_eq!(listed.items.len(), 2);
    Ok(())
}

#[tokio::test]
async fn a_k8s_openapi_slice_round_trips_through_kube() -> Result<()> {
    let api = FakeApiServer::start(&["node-a"]).await?;
    let slices: Api<ResourceSlice> = Api::all(client(&api)?);
    let device = |i: i64| Device {
        name: format!("gpu-{i}"),
        attributes: Some(BTreeMap::from([
            ("index".to_owned(), DeviceAttribute { int: Some(i), ..Default::default() }),
            (
                "productName".to_owned(),
                DeviceAttribute { string: Some("NVIDIA H200".into()), ..Default::default() },
            ),
        ])),
        capacity: Some(BTreeMap::from([(
            "memory".to_owned(),
            DeviceCapacity { value: Quantity("141Gi".into()), ..Default::default() },
        )])),
        ..Default::default()
    };
    let sent = ResourceSlice {
        metadata: ObjectMeta { generate_name: Some("node-a-gpu-".into()), ..Default::default() },
        spec: ResourceSliceSpec {
            driver: DRIVER.into(),
            node_name: Some("node-a".into()),
            pool: ResourcePool { name: "node-a".into(), generation: 1, resource_slice_count: 1 },
            devices: Some(vec![device(0), device(1)]),
            ..Default::default()
        },
    };
    let created =
        tokio::time::timeout(WAIT, slices.create(&PostParams::default(), &sent)).await??;
    assert_eq!(created.spec, sent.spec);
    let name = created.metadata.name.clone().context("a name")?;
    assert!(name.starts_with("node-a-gpu-") && name.len() == "node-a-gpu-".len() + 5, "{name}");
    assert!(created.metadata.uid.is_some() && created.metadata.resource_version.is_some());
    assert_eq!(created.metadata.generation, Some(1));
    let made = created.metadata.creation_timestamp.clone().context("a creation time")?.0;
    let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH)?.as_secs();
    let now = i64::try_from(now)?;
    assert!((made.as_second() - now).abs() < 60, "created {made}, now {now}");

    let got = tokio::time::timeout(WAIT, slices.get(&name)).await??;
    assert_eq!(got, created);
    let selector = format!("spec.nodeName=node-a,spec.driver={DRIVER}");
    let params = ListParams::default().fields(&selector);
    let listed = tokio::time::timeout(WAIT, slices.list(&params)).await??;
    assert_eq!(listed.items, std::slice::from_ref(&created));

    let mut grown = created.clone();
    grown.spec.devices = Some(vec![device(0), device(1), device(2)]);
    let replaced =
        tokio::time::timeout(WAIT, slices.replace(&name, &PostParams::default(), &grown)).await??;
    assert_eq!(replaced.metadata.generation, Some(2));
    assert_eq!(replaced.spec, grown.spec);
    // The first version is stale now.
    match tokio::time::timeout(WAIT, slices.replace(&name, &PostParams::default(), &created))
        .await?
    {
        Err(kube::Error::Api(status)) => assert_eq!(status.code, 409, "{status:?}"),
        other => anyhow::bail!("a stale replace answered {other:?}"),
    }
    let deleted =
        tokio::time::timeout(WAIT, slices.delete(&name, &DeleteParams::default())).await??;
    let deleted = deleted.left().context("the deleted slice")?;
    assert_eq!(deleted.spec, grown.spec);
    assert!(api.resource_slices().is_empty());
    Ok(())
}
