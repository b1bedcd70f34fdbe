//! `GET /plugins` (what the plugin directory holds and whether each
//! loaded) and `POST /plugins/reload` (rescan it now: what `sluice reload`
//! calls).

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::Json;

use super::AppState;

pub async fn list(State(state): State<AppState>) -> Response {
    let Some(registry) = &state.plugins else {
        return (StatusCode::NOT_FOUND, "this Sluice has no plugin directory\n").into_response();
    };
    let plugins: Vec<serde_json::Value> = registry
        .infos()
        .map(|p| {
            serde_json::json!({
                "name": p.name,
                "file": p.file,
                "kind": p.kind.map(|k| k.to_string()),
                "wit_version": p.wit_version,
                "generation": p.generation,
                "error": p.error,
            })
        })
        .collect();
    Json(serde_json::json!({ "dir": registry.dir(), "plugins": plugins })).into_response()
}

pub async fn reload(State(state): State<AppState>) -> Response {
    let Some(registry) = &state.plugins else {
        return (StatusCode::NOT_FOUND, "this Sluice has no plugin directory\n").into_response();
    };
    match registry.rescan().await {
        Ok(report) => Json(report).into_response(),
        Err(e) => (StatusCode::INTERNAL_SERVER_ERROR, format!("{e:#}\n")).into_response(),
    }
}
