//! An AdmissionReview read as it streams past and answered: only what the webhook judges is
//! kept. The request's envelope (uid, name, namespace) is read with the pod left as raw text;
//! the pod is then read container by container, each judged as soon as it has been read and
//! dropped, keeping of its resources only the keys of baleen's domain (a quantity a string or
//! a number; at most [`MAX_NAMES`] a list); everything else (`oldObject`, `args`, `env`, volumes, unknown fields) is skipped
//! without being built. So a review costs its body and a bounded remainder, whatever its shape
//! (docs/benchmarks.md, "The webhook's memory per review"): an `AdmissionReview<DynamicObject>`
//! kept every field as a JSON tree, and one 3 MiB review of `[0]` items peaked at 430 MiB.

use std::collections::BTreeMap;
use std::fmt;

use serde::Deserialize;
use serde::de::{DeserializeSeed, Deserializer, IgnoredAny, MapAccess, SeqAccess, Visitor};
use serde_json::Value;
use serde_json::value::RawValue;

use super::{MAX_NAMES, Scan, Verdict};
use crate::protocol::{Container, Resources};

/// The envelope of an AdmissionReview, the pod left unread.
#[derive(Deserialize)]
struct Envelope<'a> {
    #[serde(rename = "apiVersion", default)]
    api_version: Option<String>,
    #[serde(borrow, default)]
    request: Option<Request<'a>>,
}

/// What the webhook reads of a review's request.
#[derive(Deserialize)]
struct Request<'a> {
    uid: String,
    #[serde(default)]
    name: Option<String>,
    #[serde(default)]
    namespace: Option<String>,
    #[serde(borrow, default)]
    object: Option<&'a RawValue>,
}

/// A review's request, its pod judged.
#[derive(Debug)]
pub struct Reviewed {
    /// The review's `apiVersion`, answered in kind.
    pub api_version: String,
    /// The request's UID, which the answer repeats.
    pub uid: String,
    /// The pod's name (empty for a `generateName` pod).
    pub name: String,
    /// The pod's namespace.
    pub namespace: String,
    /// The verdict, or why the pod could not be read (it is then allowed unchanged).
    pub verdict: Result<Verdict, String>,
}

/// How a pod is judged: [`super::judge`]'s or [`super::judge_cpu_only`]'s rule.
#[derive(Debug, Clone, Copy)]
pub struct Rule<'a> {
    /// Resources of `<domain>/` are baleen's.
    pub domain: &'a str,
    /// Baleen's scheduler.
    pub scheduler: &'a str,
    /// The gpu-memory units of the largest GPU known, if any is.
    pub largest_units: Option<u32>,
    /// The opt-in webhook for CPU-only pods.
    pub cpu_only: bool,
    /// The claims and templates the extender knows, where it judges pods by their claims of
    /// baleen's class: a pod holding one is sent too.
    pub claims: Option<&'a crate::claims::ClaimIndex>,
}

/// Reads `body` as an AdmissionReview and judges its pod by `rule`; `Err` when the body is
/// not a review with a request (answered 400).
pub fn read(body: &[u8], rule: Rule<'_>) -> Result<Reviewed, String> {
    let envelope: Envelope<'_> =
        serde_json::from_slice(body).map_err(|e| format!("not an AdmissionReview: {e}"))?;
    let request =
        envelope.request.ok_or_else(|| "an AdmissionReview without a request".to_owned())?;
    let verdict = match request.object {
        None => Err("the request has no object".to_owned()),
        Some(raw) => judge_text_in(raw.get(), rule, request.namespace.as_deref().unwrap_or("")),
    };
    Ok(Reviewed {
        api_version: envelope.api_version.unwrap_or_else(|| "admission.k8s.io/v1".to_owned()),
        uid: request.uid,
        name: request.name.unwrap_or_default(),
        namespace: request.namespace.unwrap_or_default(),
        verdict,
    })
}

/// The verdict on the pod written in `text`, read as it streams (its claims, if any, looked up
/// in no namespace: see [`judge_text_in`]).
pub fn judge_text(text: &str, rule: Rule<'_>) -> Result<Verdict, String> {
    judge_text_in(text, rule, "")
}

/// The verdict on the pod of `namespace` written in `text`, read as it streams.
pub fn judge_text_in(text: &str, rule: Rule<'_>, namespace: &str) -> Result<Verdict, String> {
    let prefix = format!("{}/", rule.domain);
    let mut scan = Scan::new(&prefix, rule.largest_units);
    let mut scheduler = None;
    let mut de = serde_json::Deserializer::from_str(text);
    PodSeed { scan: &mut scan, scheduler: &mut scheduler }
        .deserialize(&mut de)
        .and_then(|()| de.end())
        .map_err(|e| e.to_string())?;
    if let Some(index) = rule.claims {
        scan.holds_baleen_claims = index.holds_counted(namespace, &scan.claims);
    }
    Ok(scan.verdict(scheduler.as_deref(), rule.scheduler, rule.cpu_only))
}

/// The answer to `reviewed`: allowed, allowed with `scheduler` patched in, or denied; a pod that
/// could not be read is allowed unchanged with a warning. Written as upstream's v1 shape, the
/// patch base64-encoded (Go's `[]byte`).
pub fn answer(reviewed: &Reviewed, scheduler: &str) -> Vec<u8> {
    let mut response = serde_json::Map::new();
    response.insert("uid".into(), Value::String(reviewed.uid.clone()));
    match &reviewed.verdict {
        Err(why) => {
            response.insert("allowed".into(), Value::Bool(true));
            response.insert(
                "warnings".into(),
                serde_json::json!([format!("baleen's webhook could not read the pod: {why}")]),
            );
        }
        Ok(Verdict::Leave) => {
            response.insert("allowed".into(), Value::Bool(true));
        }
        Ok(Verdict::Refuse(why)) => {
            response.insert("allowed".into(), Value::Bool(false));
            response.insert(
                "status".into(),
                serde_json::json!({"status": "Failure", "message": why, "reason": "Forbidden", "code": 403}),
            );
        }
        Ok(Verdict::Send) => {
            let patch = serde_json::json!([
                {"op": "add", "path": "/spec/schedulerName", "value": scheduler}
            ]);
            let patch = base64::Engine::encode(
                &base64::engine::general_purpose::STANDARD,
                patch.to_string().as_bytes(),
            );
            response.insert("allowed".into(), Value::Bool(true));
            response.insert("patchType".into(), Value::String("JSONPatch".into()));
            response.insert("patch".into(), Value::String(patch));
        }
    }
    let review = serde_json::json!({
        "apiVersion": reviewed.api_version,
        "kind": "AdmissionReview",
        "response": response,
    });
    review.to_string().into_bytes()
}

/// A pod's fields: `spec` read, the rest skipped.
struct PodSeed<'s, 'p> {
    scan: &'s mut Scan<'p>,
    scheduler: &'s mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for PodSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for PodSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Pod")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key>()? {
            if key.0 == "spec" {
                map.next_value_seed(SpecSeed { scan: self.scan, scheduler: self.scheduler })?;
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(())
    }
}

/// A pod's spec: its containers, init containers and scheduler name.
struct SpecSeed<'s, 'p> {
    scan: &'s mut Scan<'p>,
    scheduler: &'s mut Option<String>,
}

impl<'de> DeserializeSeed<'de> for SpecSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for SpecSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a PodSpec")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<(), A::Error> {
        while let Some(key) = map.next_key::<Key>()? {
            match &*key.0 {
                "containers" => {
                    map.next_value_seed(ContainersSeed { scan: self.scan, init: false })?
                }
                "initContainers" => {
                    map.next_value_seed(ContainersSeed { scan: self.scan, init: true })?;
                }
                "schedulerName" => *self.scheduler = map.next_value()?,
                "resourceClaims" => {
                    map.next_value_seed(ClaimsSeed { claims: &mut self.scan.claims })?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(())
    }
}

/// A pod's `resourceClaims` (or `null`): the first [`MAX_NAMES`] kept, the rest read past.
struct ClaimsSeed<'s> {
    claims: &'s mut Vec<crate::protocol::PodResourceClaim>,
}

impl<'de> DeserializeSeed<'de> for ClaimsSeed<'_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for ClaimsSeed<'_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of pod resource claims")
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_seq(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        while self.claims.len() < MAX_NAMES {
            match seq.next_element::<crate::protocol::PodResourceClaim>()? {
                Some(c) => self.claims.push(c),
                None => return Ok(()),
            }
        }
        while seq.next_element::<IgnoredAny>()?.is_some() {}
        Ok(())
    }
}

/// A list of containers (or `null`), each judged once read.
struct ContainersSeed<'s, 'p> {
    scan: &'s mut Scan<'p>,
    init: bool,
}

impl<'de> DeserializeSeed<'de> for ContainersSeed<'_, '_> {
    type Value = ();
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for ContainersSeed<'_, '_> {
    type Value = ();
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a list of containers")
    }
    fn visit_none<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_unit<E>(self) -> Result<(), E> {
        Ok(())
    }
    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<(), D::Error> {
        de.deserialize_seq(self)
    }
    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<(), A::Error> {
        let prefix = self.scan.prefix;
        while let Some(container) = seq.next_element_seed(ContainerSeed { prefix })? {
            self.scan.container(&container, self.init);
        }
        Ok(())
    }
}

/// One container: its name and, of its resources, the keys under `prefix` (at most one past
/// [`MAX_NAMES`] of each list, which is enough to refuse it).
struct ContainerSeed<'p> {
    prefix: &'p str,
}

impl<'de> DeserializeSeed<'de> for ContainerSeed<'_> {
    type Value = Container;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Container, D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ContainerSeed<'_> {
    type Value = Container;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a Container")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Container, A::Error> {
        let mut container = Container::default();
        while let Some(key) = map.next_key::<Key>()? {
            match &*key.0 {
                "name" => container.name = map.next_value()?,
                "resources" => {
                    container.resources = map.next_value_seed(ResourcesSeed(self.prefix))?;
                }
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(container)
    }
}

/// A container's resources: limits and requests, each cut to the keys under the prefix.
struct ResourcesSeed<'p>(&'p str);

impl<'de> DeserializeSeed<'de> for ResourcesSeed<'_> {
    type Value = Resources;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Resources, D::Error> {
        de.deserialize_map(self)
    }
}

impl<'de> Visitor<'de> for ResourcesSeed<'_> {
    type Value = Resources;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a container's resources")
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Resources, A::Error> {
        let mut resources = Resources::default();
        while let Some(key) = map.next_key::<Key>()? {
            match &*key.0 {
                "limits" => resources.limits = map.next_value_seed(OursSeed(self.0))?,
                "requests" => resources.requests = map.next_value_seed(OursSeed(self.0))?,
                _ => {
                    map.next_value::<IgnoredAny>()?;
                }
            }
        }
        Ok(resources)
    }
}

/// A resource list (or `null`): the entries whose names start with the prefix, each quantity a
/// string or a number as written (anything else is kept as `null`, which no count reads); once
/// it holds more than [`MAX_NAMES`] (the container is refused for it) the rest are skipped.
struct OursSeed<'p>(&'p str);

impl<'de> DeserializeSeed<'de> for OursSeed<'_> {
    type Value = Option<BTreeMap<String, Value>>;
    fn deserialize<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_option(self)
    }
}

impl<'de> Visitor<'de> for OursSeed<'_> {
    type Value = Option<BTreeMap<String, Value>>;
    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str("a resource list")
    }
    fn visit_none<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_unit<E>(self) -> Result<Self::Value, E> {
        Ok(None)
    }
    fn visit_some<D: Deserializer<'de>>(self, de: D) -> Result<Self::Value, D::Error> {
        de.deserialize_map(self)
    }
    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut ours = BTreeMap::new();
        while let Some(key) = map.next_key::<Key>()? {
            if key.0.starts_with(self.0) && ours.len() <= MAX_NAMES {
                let Scalar(value) = map.next_value()?;
                ours.insert(key.0.into_owned(), value);
            } else {
                map.next_value::<IgnoredAny>()?;
            }
        }
        Ok(Some(ours))
    }
}

/// A map key, borrowed from the text when it has no escapes.
struct Key<'de>(std::borrow::Cow<'de, str>);

impl<'de> Deserialize<'de> for Key<'de> {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct KeyVisitor;
        impl<'de> Visitor<'de> for KeyVisitor {
            type Value = Key<'de>;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a field name")
            }
            fn visit_borrowed_str<E>(self, v: &'de str) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Borrowed(v)))
            }
            fn visit_str<E>(self, v: &str) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Owned(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Key<'de>, E> {
                Ok(Key(std::borrow::Cow::Owned(v)))
            }
        }
        de.deserialize_str(KeyVisitor)
    }
}

/// A quantity as written: a string or a number; any other value is skipped and read as `null`.
struct Scalar(Value);

impl<'de> Deserialize<'de> for Scalar {
    fn deserialize<D: Deserializer<'de>>(de: D) -> Result<Self, D::Error> {
        struct ScalarVisitor;
        impl<'de> Visitor<'de> for ScalarVisitor {
            type Value = Scalar;
            fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str("a quantity")
            }
            fn visit_str<E>(self, v: &str) -> Result<Scalar, E> {
                Ok(Scalar(Value::String(v.to_owned())))
            }
            fn visit_string<E>(self, v: String) -> Result<Scalar, E> {
                Ok(Scalar(Value::String(v)))
            }
            fn visit_u64<E>(self, v: u64) -> Result<Scalar, E> {
                Ok(Scalar(Value::from(v)))
            }
            fn visit_i64<E>(self, v: i64) -> Result<Scalar, E> {
                Ok(Scalar(Value::from(v)))
            }
            fn visit_f64<E>(self, v: f64) -> Result<Scalar, E> {
                Ok(Scalar(Value::from(v)))
            }
            fn visit_bool<E>(self, _: bool) -> Result<Scalar, E> {
                Ok(Scalar(Value::Null))
            }
            fn visit_unit<E>(self) -> Result<Scalar, E> {
                Ok(Scalar(Value::Null))
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Scalar, A::Error> {
                while seq.next_element::<IgnoredAny>()?.is_some() {}
                Ok(Scalar(Value::Null))
            }
            fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Scalar, A::Error> {
                while map.next_entry::<IgnoredAny, IgnoredAny>()?.is_some() {}
                Ok(Scalar(Value::Null))
            }
        }
        de.deserialize_any(ScalarVisitor)
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::protocol::Pod;
    use serde_json::json;

    const D: &str = "awesome-ai-company.com";

    fn rule(cpu_only: bool) -> Rule<'static> {
        Rule {
            domain: D,
            scheduler: "baleen-scheduler",
            largest_units: Some(140),
            cpu_only,
            claims: None,
        }
    }

    /// The verdict streamed, held to the verdict on the pod parsed whole, for both rules (the
    /// same words, but for a quantity that is no scalar: the stream keeps none of it).
    fn streamed(pod: &Value) -> Verdict {
        let text = pod.to_string();
        let whole: Pod = serde_json::from_value(pod.clone()).expect("a pod");
        for cpu_only in [true, false] {
            let by_stream = judge_text(&text, rule(cpu_only)).expect("read");
            let by_whole = if cpu_only {
                super::super::judge_cpu_only(&whole, D)
            } else {
                super::super::judge(&whole, D, "baleen-scheduler", Some(140))
            };
            let words = |v: &Verdict| match v {
                Verdict::Refuse(why) if why.contains(" = null ") => "null".to_owned(),
                Verdict::Refuse(why) if why.contains(" = [") => "null".to_owned(),
                other => format!("{other:?}"),
            };
            assert_eq!(words(&by_stream), words(&by_whole), "{text}");
        }
        judge_text(&text, rule(false)).expect("read")
    }

    fn with(containers: Value, init: Value) -> Value {
        json!({"metadata": {"name": "p"}, "spec": {"initContainers": init, "containers": containers,
            "volumes": [{"name": "v", "emptyDir": {}}]}, "status": {}})
    }

    #[test]
    fn the_streamed_verdict_is_the_verdict_on_the_whole_pod() {
        let limits = |m: Value| json!([{"name": "c", "args": ["x"], "resources": {"limits": m}}]);
        let gpu = limits(json!({"awesome-ai-company.com/gpu-memory": "8", "cpu": "1"}));
        assert_eq!(streamed(&with(gpu.clone(), Value::Null)), Verdict::Send);
        assert_eq!(streamed(&with(limits(json!({"cpu": "1"})), json!([]))), Verdict::Leave);
        // The first problem of the containers wins over an init container's, whatever the order
        // the fields come in.
        let bad = |name: &str| json!([{"name": name, "resources": {"requests": {"awesome-ai-company.com/gpu-memory": "1"}}}]);
        let Verdict::Refuse(why) = streamed(&with(bad("app"), bad("init"))) else { panic!() };
        assert!(why.starts_with("container app:"), "{why}");
        let Verdict::Refuse(why) = streamed(&with(gpu.clone(), bad("init"))) else { panic!() };
        assert!(why.starts_with("container init:"), "{why}");
        // A quantity that is no scalar is kept as null, and refused as no count.
        let odd = limits(json!({"awesome-ai-company.com/gpu-memory": [0, [0]]}));
        let Verdict::Refuse(why) = streamed(&with(odd, Value::Null)) else { panic!() };
        assert!(why.contains("not a whole positive number"), "{why}");
        // Too many names of the domain: refused, by both (the stream keeps one past the bound).
        let many: serde_json::Map<String, Value> =
            (0..=MAX_NAMES).map(|i| (format!("{D}/x{i}"), json!(1))).collect();
        let Verdict::Refuse(why) = streamed(&with(limits(Value::Object(many)), Value::Null)) else {
            panic!()
        };
        assert!(why.contains(&format!("more than {MAX_NAMES}")), "{why}");
        let mut named = with(gpu, Value::Null);
        named["spec"]["schedulerName"] = json!("volcano");
        assert_eq!(streamed(&named), Verdict::Leave);
    }

    #[test]
    fn a_pod_holding_a_claim_of_baleens_class_is_sent_where_the_extender_judges_claims() {
        let index = crate::claims::ClaimIndex::new(crate::claims::ClaimSettings {
            classes: vec!["gpu.awesome-ai-company.com".into()],
            memory_unit_bytes: 1 << 30,
        });
        let template: k8s_openapi::api::resource::v1::ResourceClaimTemplate =
            serde_json::from_value(json!({
                "apiVersion": "resource.k8s.io/v1", "kind": "ResourceClaimTemplate",
                "metadata": {"name": "share-20", "namespace": "team-a"},
                "spec": {"spec": {"devices": {"requests": [{"name": "gpu", "exactly": {
                    "deviceClassName": "gpu.awesome-ai-company.com",
                    "capacity": {"requests": {"memory": "20Gi"}}}}]}}}
            }))
            .expect("template");
        index.apply_template(&template);
        let mut pod =
            with(json!([{"name": "c", "resources": {"claims": [{"name": "gpu"}]}}]), Value::Null);
        pod["spec"]["resourceClaims"] = json!([{"name": "nic", "resourceClaimTemplateName": "nic"},
                   {"name": "gpu", "resourceClaimTemplateName": "share-20"}]);
        let text = pod.to_string();
        let judged = |namespace: &str, claims| {
            judge_text_in(&text, Rule { claims, ..rule(false) }, namespace).expect("read")
        };
        assert_eq!(judged("team-a", Some(&index)), Verdict::Send);
        // Its template is of another namespace; or the extender does not judge claims.
        assert_eq!(judged("team-b", Some(&index)), Verdict::Leave);
        assert_eq!(judged("team-a", None), Verdict::Leave);
        // A pod that names its scheduler keeps it.
        pod["spec"]["schedulerName"] = json!("volcano");
        let named =
            judge_text_in(&pod.to_string(), Rule { claims: Some(&index), ..rule(false) }, "team-a");
        assert_eq!(named.expect("read"), Verdict::Leave);
        // Past MAX_NAMES claims, the rest are read past, not kept.
        let many: Vec<Value> = (0..MAX_NAMES + 5)
            .map(|i| json!({"name": format!("c{i}"), "resourceClaimTemplateName": "share-20"}))
            .collect();
        let mut scan = Scan::new("awesome-ai-company.com/", None);
        let mut scheduler = None;
        let text = json!({"spec": {"resourceClaims": many}}).to_string();
        let mut de = serde_json::Deserializer::from_str(&text);
        PodSeed { scan: &mut scan, scheduler: &mut scheduler }.deserialize(&mut de).expect("read");
        assert_eq!(scan.claims.len(), MAX_NAMES);
    }

    #[test]
    fn a_review_is_answered_in_upstreams_shape() {
        let pod = with(
            json!([{"name": "c", "resources": {"limits": {"awesome-ai-company.com/gpu-memory": 8}}}]),
            Value::Null,
        );
        let body = json!({"apiVersion": "admission.k8s.io/v1", "kind": "AdmissionReview",
            "request": {"uid": "u-1", "name": "p", "namespace": "n", "object": pod,
                        "oldObject": {"spec": {"containers": "anything, skipped"}}}});
        let reviewed = read(body.to_string().as_bytes(), rule(false)).expect("a review");
        assert_eq!((reviewed.uid.as_str(), reviewed.namespace.as_str()), ("u-1", "n"));
        let out: Value = serde_json::from_slice(&answer(&reviewed, "s")).expect("JSON");
        assert_eq!(out["response"]["uid"], "u-1");
        assert_eq!(out["response"]["allowed"], true);
        let patch = base64::Engine::decode(
            &base64::engine::general_purpose::STANDARD,
            out["response"]["patch"].as_str().expect("patch"),
        )
        .expect("base64");
        let patch: Value = serde_json::from_slice(&patch).expect("a JSON patch");
        assert_eq!(patch, json!([{"op": "add", "path": "/spec/schedulerName", "value": "s"}]));
        // Refused: 403 with the reason; unreadable: allowed with a warning; no request: an error.
        let mut refused = body.clone();
        refused["request"]["object"]["spec"]["containers"][0]["resources"]["limits"]["awesome-ai-company.com/gpu-memory"] =
            json!(141);
        let reviewed = read(refused.to_string().as_bytes(), rule(false)).expect("a review");
        let out: Value = serde_json::from_slice(&answer(&reviewed, "s")).expect("JSON");
        assert_eq!(out["response"]["allowed"], false);
        assert_eq!(out["response"]["status"]["code"], 403);
        assert!(out["response"]["status"]["message"].as_str().is_some_and(|m| m.contains("141")));
        let mut odd = body.clone();
        odd["request"]["object"]["spec"]["containers"] = json!(7);
        let reviewed = read(odd.to_string().as_bytes(), rule(false)).expect("a review");
        assert!(reviewed.verdict.is_err());
        let out: Value = serde_json::from_slice(&answer(&reviewed, "s")).expect("JSON");
        assert_eq!(out["response"]["allowed"], true);
        assert!(out["response"]["warnings"][0].as_str().is_some_and(|w| w.contains("could not")));
        assert!(read(br#"{"apiVersion":"admission.k8s.io/v1"}"#, rule(false)).is_err());
        assert!(read(b"[1]", rule(false)).is_err());
    }
}
