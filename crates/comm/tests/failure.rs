//! Failure never hangs: a rank that panics, returns an error, never arrives, or returns
//! early makes every other rank's blocked operation fail with an error that names the
//! operation, the rank and the peer or group.
//!
//! The timeout here is long (60 s) wherever the test is about being *woken* by a failure,
//! and every test checks that it finished in well under that: a rank that was not woken
//! would only return at the timeout. The bound is a hang detector, not a speed claim.

use std::time::{Duration, Instant};

use candle_core::{Device, Tensor};
use switchyard_comm::local::{FailureKind, Launcher};
use switchyard_comm::{Communicator, ReduceOp};

const LONG: Duration = Duration::from_secs(60);
const PROMPT: Duration = Duration::from_secs(10);

fn ones() -> Tensor {
    Tensor::ones(4, candle_core::DType::F32, &Device::Cpu).unwrap()
}

/// Every rank but `culprit` failed, with a message naming `op`, itself and `culprit`.
fn assert_others_failed<T: std::fmt::Debug>(
    outcomes: &[Result<T, switchyard_comm::local::RankFailure>],
    culprit: usize,
    op: &str,
) {
    for (r, o) in outcomes.iter().enumerate() {
        if r == culprit {
            continue;
        }
        let f = o
            .as_ref()
            .expect_err("a surviving rank must fail, not succeed");
        let m = &f.message;
        assert!(m.contains(op), "rank {r}: {m}");
        assert!(m.contains(&format!("on rank {r}")), "rank {r}: {m}");
        assert!(m.contains(&format!("rank {culprit}")), "rank {r}: {m}");
    }
}

#[test]
fn a_panicking_rank_fails_every_collective() {
    let start = Instant::now();
    let outcomes = Launcher::new(4).timeout(LONG).run_each(|comm| {
        if comm.rank() == 2 {
            panic!("rank two blew up");
        }
        comm.all_reduce(&ones(), ReduceOp::Sum).map(|_| ())
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    let culprit = outcomes[2].as_ref().unwrap_err();
    assert_eq!(culprit.kind, FailureKind::Panic);
    assert!(culprit.message.contains("rank two blew up"));
    assert_others_failed(&outcomes, 2, "all_reduce");
    for o in &outcomes {
        if let Err(f) = o {
            if f.rank != 2 {
                assert!(f.message.contains("world[0,1,2,3]"), "{}", f.message);
            }
        }
    }
}

#[test]
fn launch_reports_the_first_failure() {
    let err = Launcher::new(3)
        .timeout(LONG)
        .run(|comm| {
            if comm.rank() == 1 {
                return Err("disk full".to_string());
            }
            comm.barrier().map_err(|e| e.to_string())
        })
        .unwrap_err();
    assert_eq!(err.first.rank, 1);
    assert!(err.first.message.contains("disk full"));
    assert_eq!(err.others.len(), 2);
    assert!(err.to_string().contains("rank 1 failed: disk full"));
}

#[test]
fn an_erroring_rank_fails_its_receivers() {
    let start = Instant::now();
    let outcomes = Launcher::new(3).timeout(LONG).run_each(|comm| {
        if comm.rank() == 1 {
            std::thread::sleep(Duration::from_millis(50));
            return Err("bad batch".to_string());
        }
        comm.recv(1, 7).map(|_| ()).map_err(|e| e.to_string())
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    assert_eq!(outcomes[1].as_ref().unwrap_err().kind, FailureKind::Error);
    assert_others_failed(&outcomes, 1, "recv");
    let m = &outcomes[0].as_ref().unwrap_err().message;
    assert!(m.contains("peer rank 1") && m.contains("bad batch"), "{m}");
}

#[test]
fn a_failure_reaches_sub_groups_and_later_operations() {
    let start = Instant::now();
    let outcomes = Launcher::new(4).timeout(LONG).run_each(|comm| {
        let sub = comm.split_named(comm.rank() % 2, comm.rank(), "tp")?;
        if comm.rank() == 0 {
            panic!("rank zero panicked");
        }
        if comm.rank() == 3 {
            // Not blocked when the failure happens: the next operation fails at once.
            std::thread::sleep(Duration::from_millis(300));
            return sub.all_gather(&ones(), 0).map(|_| ());
        }
        sub.barrier()
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    let m1 = &outcomes[1].as_ref().unwrap_err().message;
    assert!(m1.contains("barrier") && m1.contains("tp[1,3]"), "{m1}");
    let m3 = &outcomes[3].as_ref().unwrap_err().message;
    assert!(m3.contains("all_gather") && m3.contains("rank 0"), "{m3}");
}

#[test]
fn a_rank_that_never_arrives_times_out_everyone() {
    let start = Instant::now();
    let outcomes = Launcher::new(3)
        .timeout(Duration::from_millis(300))
        .run_each(|comm| {
            if comm.rank() == 2 {
                // Busy elsewhere for longer than the timeout, then it leaves.
                std::thread::sleep(Duration::from_millis(1500));
                return Ok(());
            }
            comm.all_reduce(&ones(), ReduceOp::Max).map(|_| ())
        });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    for r in [0, 1] {
        let m = &outcomes[r].as_ref().unwrap_err().message;
        assert!(
            m.contains("all_reduce") && m.contains(&format!("on rank {r}")),
            "{m}"
        );
        assert!(m.contains("timed out"), "{m}");
    }
    assert!(outcomes[2].is_ok());
}

#[test]
fn a_receive_from_a_silent_rank_times_out() {
    let outcomes = Launcher::new(2)
        .timeout(Duration::from_millis(200))
        .run_each(|comm| {
            if comm.rank() == 1 {
                std::thread::sleep(Duration::from_millis(800));
                return Ok(());
            }
            comm.recv(1, 0).map(|_| ())
        });
    let m = &outcomes[0].as_ref().unwrap_err().message;
    assert!(
        m.contains("recv on rank 0 timed out") && m.contains("peer rank 1"),
        "{m}"
    );
}

#[test]
fn a_peer_that_returns_without_sending_ends_the_wait() {
    let start = Instant::now();
    let outcomes = Launcher::new(2).timeout(LONG).run_each(|comm| {
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.recv(1, 5).map(|_| ())
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    let m = &outcomes[0].as_ref().unwrap_err().message;
    assert!(m.contains("returned without sending tag 5"), "{m}");
}

#[test]
fn a_message_sent_before_the_sender_returns_is_still_delivered() {
    let out = Launcher::new(2)
        .timeout(LONG)
        .run(|comm| {
            if comm.rank() == 1 {
                comm.send(&ones(), 0, 9)?;
                return Ok(0.0);
            }
            std::thread::sleep(Duration::from_millis(100));
            comm.recv(1, 9)?.sum_all()?.to_scalar::<f32>()
        })
        .unwrap();
    assert_eq!(out[0], 4.0);
}

#[test]
fn a_collective_a_peer_skipped_fails_when_it_returns() {
    let start = Instant::now();
    let outcomes = Launcher::new(2).timeout(LONG).run_each(|comm| {
        if comm.rank() == 1 {
            return Ok(());
        }
        comm.barrier()
    });
    assert!(start.elapsed() < PROMPT, "took {:?}", start.elapsed());
    let m = &outcomes[0].as_ref().unwrap_err().message;
    assert!(
        m.contains("barrier") && m.contains("returned without joining"),
        "{m}"
    );
}

#[test]
fn world_size_zero_is_an_error() {
    let err = Launcher::new(0).run(|_| Ok::<_, String>(())).unwrap_err();
    assert!(err.to_string().contains("world size 0"));
}

#[test]
fn p2p_is_zero_copy_and_detached() {
    // The receiver gets the sender's buffer, not a copy, and no autograd graph.
    Launcher::new(2)
        .run(|comm: std::sync::Arc<dyn Communicator>| {
            let v = candle_core::Var::new(&[1f32, 2., 3.], &Device::Cpu)?;
            let y = (v.as_tensor() * 2.0)?;
            if comm.rank() == 0 {
                comm.send(&y, 1, 0)?;
                let addr = comm.recv(1, 1)?.to_vec1::<f64>()?;
                let (s, _) = y.storage_and_layout();
                let candle_core::Storage::Cpu(c) = &*s else {
                    unreachable!()
                };
                let mine = c.as_slice::<f32>()?.as_ptr() as usize as f64;
                assert_eq!(addr[0], mine, "the receiver saw another buffer");
            } else {
                let got = comm.recv(0, 0)?;
                assert!(!got.track_op(), "a received tensor must not carry a graph");
                let (s, _) = got.storage_and_layout();
                let candle_core::Storage::Cpu(c) = &*s else {
                    unreachable!()
                };
                let addr = c.as_slice::<f32>()?.as_ptr() as usize as f64;
                drop(s);
                comm.send(&Tensor::new(&[addr], &Device::Cpu)?, 0, 1)?;
            }
            Ok::<_, candle_core::Error>(())
        })
        .unwrap();
}
