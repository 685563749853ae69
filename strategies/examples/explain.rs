//! Shows what the sharding compiler decides for one op, or plans one redistribution.
//!
//! ```text
//! cargo run --release -p candle-dtensor-strategies --example explain -- \
//!     --mesh dp=2,tp=2 --op matmul --shapes 64x32,32x64 --placements "S(0),R;R,S(1)" --json
//! cargo run --release -p candle-dtensor-strategies --example explain -- \
//!     --mesh dp=2,tp=2 --op redistribute --shapes 8x4 --placements "S(0),S(0)" --to "R,R"
//! ```
//!
//! Inputs are separated by `;`, mesh dims by `,`; shapes are `AxB` separated by `,` (an optional
//! `:dtype` per shape, e.g. `4x16:u32`). Errors go to stderr with a non-zero exit.
#![allow(clippy::print_stdout, clippy::print_stderr)]

use clap::Parser;

use candle_dtensor_strategies::{explain, ExpandMethod, ExplainRequest};

#[derive(Parser, Debug)]
#[command(about = "Explain a sharding decision of candle-dtensor")]
struct Args {
    /// Mesh, e.g. `dp=2,tp=2`.
    #[arg(long)]
    mesh: String,
    /// DTensor method name (`matmul`, `add`, `sum`, `softmax`, ...) or `redistribute`.
    #[arg(long)]
    op: String,
    /// Input shapes, e.g. `64x32,32x64` (optional `:dtype` per shape).
    #[arg(long, default_value = "")]
    shapes: String,
    /// Input placements, inputs separated by `;`, e.g. `S(0),R;R,S(1)` (default: replicated).
    #[arg(long, default_value = "", allow_hyphen_values = true)]
    placements: String,
    /// Dim arguments, e.g. `0` or `0,1` (negative allowed).
    #[arg(long, allow_hyphen_values = true)]
    dims: Option<String>,
    /// Keep reduced dims.
    #[arg(long)]
    keepdim: bool,
    /// Target shape of reshape / broadcast_as, e.g. `16x6`.
    #[arg(long)]
    to_shape: Option<String>,
    /// dtype of float inputs (default f32).
    #[arg(long)]
    dtype: Option<String>,
    /// Target placements for `--op redistribute`.
    #[arg(long, allow_hyphen_values = true)]
    to: Option<String>,
    /// Target dtype of `to_dtype`.
    #[arg(long)]
    to_dtype: Option<String>,
    /// Scalar argument (scalar ops, affine multiplier, masked_fill value, dropout p).
    #[arg(long, allow_hyphen_values = true)]
    scalar: Option<f64>,
    /// Causal attention (sdpa).
    #[arg(long)]
    causal: bool,
    /// Mesh dims with a flattened communicator, e.g. `dp,tp` (repeatable).
    #[arg(long)]
    flatten: Vec<String>,
    /// Search: auto, product or dijkstra.
    #[arg(long, default_value = "auto", value_parser = ["auto", "product", "dijkstra"])]
    method: String,
    /// Print one JSON object instead of a table.
    #[arg(long)]
    json: bool,
}

fn main() {
    let a = Args::parse();
    let req = ExplainRequest {
        mesh: a.mesh,
        flatten: a.flatten,
        op: a.op,
        shapes: a.shapes,
        placements: a.placements,
        dims: a.dims,
        keepdim: a.keepdim,
        to_shape: a.to_shape,
        dtype: a.dtype,
        to: a.to,
        to_dtype: a.to_dtype,
        scalar: a.scalar,
        causal: a.causal,
        method: match a.method.as_str() {
            "product" => ExpandMethod::Product,
            "dijkstra" => ExpandMethod::Dijkstra,
            _ => ExpandMethod::Auto,
        },
    };
    match explain(&req) {
        Ok(report) => {
            if a.json {
                match serde_json::to_string(&report) {
                    Ok(s) => println!("{s}"),
                    Err(e) => {
                        eprintln!("error: {e}");
                        std::process::exit(1);
                    }
                }
            } else {
                println!("{report}");
            }
        }
        Err(e) => {
            eprintln!("error: {e}");
            std::process::exit(2);
        }
    }
}
