//! rota-scheduler
